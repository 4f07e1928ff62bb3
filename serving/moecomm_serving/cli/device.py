"""Command-line options of the GPU path, shared by `moecomm expert-server`, `frontend` and `demo`.

``--device cuda`` puts the experts (server) or the slots (front end) in GPU memory: the server
becomes a :class:`moecomm.runtime.DeviceExpertServer` and serves CUDA-IPC clients on its node;
the front end dispatches through a :class:`moecomm.runtime.DeviceClient`. The GPU server fixes
its slot layout at start (``--max-tokens``, ``--topk``, ``--encoding``); clients must match it,
and learn it from the server's GET /transports. Needs a CUDA device and moecomm built with CUDA;
without one, the command fails at start naming why.
"""

from __future__ import annotations

import argparse

import torch
from moecomm.runtime.experts import random_experts
from moecomm.wire.protocol import SlotLayout, as_encoding

__all__ = ["add_device_arguments", "device_layout", "parse_random_spec", "random_hosted"]

# Keys of --random-experts and their defaults (a small model that fits any GPU).
_RANDOM_DEFAULTS = {"layers": 1, "experts": 8, "hidden": 1024, "intermediate": 512, "seed": 0}


def add_device_arguments(p: argparse.ArgumentParser, server: bool) -> None:
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu (host path, default) or cuda / cuda:N: the GPU path over CUDA IPC on this "
        "node (needs a GPU and a CUDA build of moecomm)",
    )
    if not server:
        return
    p.add_argument("--max-tokens", type=int, default=128, help="GPU server: tokens per request")
    p.add_argument("--topk", type=int, default=8, help="GPU server: experts per token")
    p.add_argument(
        "--encoding",
        default="bf16",
        help="GPU server: request activations (bf16, fp16, f32, int8, fp8, fp8_e4m3_b128)",
    )
    p.add_argument("--max-clients", type=int, default=8, help="GPU server: CUDA-IPC clients")
    p.add_argument("--num-slots", type=int, default=2, help="GPU server: slots per client")
    p.add_argument(
        "--nvshmem-job",
        type=int,
        default=0,
        metavar="N",
        help="GPU server: create an NVSHMEM job of N PEs, this server PE 0; the others join "
        "with --nvshmem-join URL (POST /nvshmem/join hands out the unique id and ranks)",
    )
    p.add_argument(
        "--nvshmem-join",
        default=None,
        metavar="URL",
        help="GPU server: join the NVSHMEM job created by the server at URL",
    )
    p.add_argument(
        "--random-experts",
        default=None,
        metavar="SPEC",
        help="instead of --checkpoint: seeded random experts, e.g. "
        "'layers=1,experts=288,hidden=7168,intermediate=256,seed=0' (benchmarks)",
    )


def start_nvshmem(args: argparse.Namespace, server, member_id: str) -> None:
    """--nvshmem-job / --nvshmem-join: form the job over the control plane, then initialise
    NVSHMEM in the background (init is collective: it returns once every PE is in)."""
    import threading

    import moecomm.wire.cuda
    from moecomm.runtime.nvshmem_job import NvshmemJob, join_job

    if args.nvshmem_job and args.nvshmem_join:
        raise SystemExit("give one of --nvshmem-job and --nvshmem-join")
    if args.nvshmem_job:
        server.nvshmem_job = NvshmemJob.create(args.nvshmem_job, member_id)
        job = {"unique_id": server.nvshmem_job.unique_id, "rank": 0, "nranks": args.nvshmem_job}
    elif args.nvshmem_join:
        job = join_job(args.nvshmem_join, member_id, args.token)
    else:
        return
    nv = moecomm.wire.cuda.nvshmem_module()
    device = torch.device(args.device)
    index = device.index if device.index is not None else torch.cuda.current_device()

    def init() -> None:
        nv.init(job["unique_id"], job["rank"], job["nranks"], index)
        print(f"NVSHMEM: PE {job['rank']} of {job['nranks']} initialised", flush=True)

    threading.Thread(target=init, name="nvshmem-init", daemon=True).start()
    print(f"NVSHMEM: PE {job['rank']} of {job['nranks']}, waiting for the others", flush=True)


def is_cuda(args: argparse.Namespace) -> bool:
    return str(args.device).startswith("cuda")


def require_gpu(command: str) -> None:
    """`command` was given --device cuda: exits naming why when this process cannot use a GPU
    (no device, or moecomm built without CUDA), before anything starts."""
    import moecomm.wire.cuda

    if not moecomm.wire.cuda.available():
        raise SystemExit(
            f"{command} --device cuda needs a GPU: {moecomm.wire.cuda.why_unavailable()}"
        )


def device_layout(args: argparse.Namespace, hidden: int) -> SlotLayout:
    """The slot layout a GPU server serves, from its options."""
    if args.max_tokens < 1 or args.topk < 1:
        raise SystemExit("--max-tokens and --topk must be >= 1")
    try:
        enc = as_encoding(args.encoding)
    except ValueError as exc:
        raise SystemExit(f"--encoding: {exc}") from exc
    return SlotLayout(args.max_tokens, hidden, args.topk, enc, as_encoding("bf16"))


def parse_random_spec(spec: str) -> dict[str, int]:
    """'layers=1,experts=8,...' -> the random_experts arguments; unknown keys are an error."""
    out = dict(_RANDOM_DEFAULTS)
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in out:
            raise SystemExit(
                f"--random-experts: bad item {item!r}; keys are {', '.join(_RANDOM_DEFAULTS)}"
            )
        try:
            out[key] = int(value)
        except ValueError as exc:
            raise SystemExit(f"--random-experts: {key} must be an integer, got {value!r}") from exc
        if out[key] < (0 if key == "seed" else 1):
            raise SystemExit(f"--random-experts: {key} must be positive, got {out[key]}")
    return out


def random_hosted(spec: str, dtype: torch.dtype) -> dict:
    r = parse_random_spec(spec)
    return random_experts(
        r["layers"], r["experts"], r["hidden"], r["intermediate"], seed=r["seed"], dtype=dtype
    )
