"""`moecomm demo` (what `make demo` runs): the whole system on the tiny checkpoint, as separate
processes on 127.0.0.1 — the embedded monitor, two expert servers (experts 0-11 and 4-15, so
4-11 have a replica) and a front end that finds them through the monitor — then a few prompts
through the OpenAI API, a metrics summary, and a clean shutdown (also on Ctrl-C). With
``--stages 2`` the front end splits the model over two pipeline stage processes, each calling
the expert servers through its own client. With ``--device cuda`` (needs a GPU and a CUDA build)
the expert servers host their experts in GPU memory and the front end reaches them through a
DeviceClient over CUDA IPC: the GPU path end to end. With ``--pd`` the prompts run split: a
prefill front end (``--role prefill``) and a decode front end (``--role decode``), both clients
of the expert servers, behind ``moecomm router``, which hands each prompt's KV blocks from the
first to the second; the processes share a deployment secret the demo generates (the split's
internal routes refuse callers without it), and every prompt takes the split (the router's
``--max-local-prefill-tokens 0``) to show the hand-off."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
from moecomm.auth import generate
from moecomm.testing.procs import MONITOR_CMD, Proc, Processes, wait_all

from moecomm_serving.api.auth import PD_SECRET_ENV

CLI = [sys.executable, "-m", "moecomm_serving.cli"]
# Start-up of a child `moecomm` process (it imports torch and loads the checkpoint) on a busy
# 2-core machine.
CHILD_START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0
# What a front end with --stages N prints once its standby stage processes are up.
STANDBY_READY = "pipeline standby stages ready"
HTTP_TIMEOUT_S = 120.0
SERVER_EXPERTS = ("0-11", "4-15")
PROMPTS = ["The experts are", "Once upon a time", "moecomm moves tokens"]
MAX_TOKENS = 16
# Four processes share this machine's cores: one torch thread each, or their thread pools spin
# against each other.
ONE_THREAD = ("--threads", "1")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The demo's options (its model family and device are the tiny checkpoint's and the GPU
    path's own options)."""
    from moecomm_serving.cli.device import add_device_arguments
    from moecomm_serving.model import tiny

    p.add_argument(
        "--stages",
        type=int,
        default=1,
        help="pipeline stages of the front end (2: the model split over two stage processes, "
        "each calling the expert servers)",
    )
    p.add_argument(
        "--pd",
        action="store_true",
        help="prefill and decode on separate front ends behind `moecomm router`",
    )
    tiny.add_arch_argument(p, help="model family of the tiny checkpoint")
    add_device_arguments(p, server=False)


def say(msg: str) -> None:
    print(msg, flush=True)


def show(proc: Proc, line: str) -> None:
    """A child's line, printed while the demo waits for it to serve."""
    say(f"  [{proc.name}] {line}")


def start(procs: Processes, name: str, args: list[str], argv: list[str] | None = None) -> Proc:
    """`moecomm <args>` (or `argv`) as `name`, its output shown until it announced it serves."""
    p = procs.spawn(name, [*CLI, *args] if argv is None else argv)
    p.wait_ready(CHILD_START_TIMEOUT_S, on_output=show)
    return p


def stop_all(procs: Processes) -> None:
    """Every child stopped (SIGINT, SIGKILL after STOP_TIMEOUT_S), the last started first."""
    for name, code in procs.close(signal.SIGINT, STOP_TIMEOUT_S).items():
        say(f"  stopped {name} (exit {code})")


def complete(url: str, prompt: str) -> tuple[str, float]:
    t0 = time.perf_counter()
    r = httpx.post(
        f"{url}/v1/completions",
        timeout=HTTP_TIMEOUT_S,
        json={"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0},
    )
    r.raise_for_status()
    return r.json()["choices"][0]["text"], time.perf_counter() - t0


def stream_chat(url: str, content: str) -> str:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.8,
        "seed": 7,
        "stream": True,
    }
    out = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=HTTP_TIMEOUT_S) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                out.append(delta.get("content", ""))
    return "".join(out)


def metric_summary(url: str) -> list[str]:
    """Means of the latency summaries and the gauges of the front end's /metrics."""
    values: dict[str, float] = {}
    for ln in httpx.get(f"{url}/metrics", timeout=HTTP_TIMEOUT_S).text.splitlines():
        if ln and not ln.startswith("#"):
            name, _, value = ln.rpartition(" ")
            values[name.split("{")[0]] = float(value)
    out = []
    for label, base in (
        ("TTFT", "time_to_first_token"),
        ("TPOT", "time_per_output_token"),
        ("ITL", "inter_token_latency"),
        ("E2E", "e2e_request_latency"),
    ):
        total = values.get(f"moecomm_{base}_seconds_sum")
        count = values.get(f"moecomm_{base}_seconds_count")
        if total is not None and count:
            out.append(f"{label} mean {total / count * 1e3:.1f} ms over {count:.0f}")
    for label, name in (
        ("generation tokens/s", "moecomm_generation_tokens_per_second"),
        ("queue depth", "moecomm_queue_depth"),
        ("failovers", "moecomm_failovers_total"),
    ):
        if name in values:
            out.append(f"{label} {values[name]:g}")
    return out


def pd_metric_lines(url: str, prefix: str) -> list[str]:
    """The samples of `url`'s /metrics whose name starts with `prefix` (no HELP/TYPE lines)."""
    text = httpx.get(f"{url}/metrics", timeout=HTTP_TIMEOUT_S).text
    return [ln for ln in text.splitlines() if ln.startswith(prefix)]


def start_expert_servers(procs: Processes, ckpt: str, monitor: str, gpu: list[str]) -> list[str]:
    """The two expert servers of SERVER_EXPERTS, registered with the monitor, started together;
    their URLs."""
    servers = []
    for i, experts in enumerate(SERVER_EXPERTS):
        say(f"3.{i + 1} starting expert server {i} with experts {experts}")
        args = ["expert-server", "--checkpoint", ckpt, "--experts", experts]
        args += ["--id", f"demo-server-{i}", "--monitor", monitor, *ONE_THREAD, *gpu]
        servers.append(procs.moecomm(f"expert-server-{i}", args, wait=False))
    wait_all(servers, CHILD_START_TIMEOUT_S, on_output=show)
    for s in servers:
        r = s.ready
        experts = r["experts"]
        say(
            f"   expert server {r['server_id']} at {s.url}: layers {r['layers']}, "
            f"experts {experts[0]}..{experts[-1]} ({len(experts)})"
        )
    return [s.url for s in servers]


def start_frontend(procs: Processes, name: str, ckpt: str, monitor: str, extra: list[str]) -> str:
    """A `moecomm frontend` that finds the servers through the monitor; its URL."""
    args = ["frontend", "--checkpoint", ckpt, "--model-name", "tiny", "--monitor", monitor]
    p = start(procs, name, [*args, *ONE_THREAD, "--port", "0", *extra])
    role = f" (role {p.ready['pd_role']})" if p.ready.get("pd_role") else ""
    say(f"   frontend {p.ready['name']}{role} at {p.url}")
    return p.url


def start_pd(procs: Processes, ckpt: str, monitor: str) -> tuple[str, dict[str, str]]:
    """Steps 4-5 of ``--pd``: the prefill and the decode front end, then the router in front of
    them; the router's URL and the front ends' by role."""
    say("4.1 starting the prefill front end (runs each prompt, hands its KV blocks on)")
    prefill = start_frontend(procs, "prefill-frontend", ckpt, monitor, ["--role", "prefill"])
    say("4.2 starting the decode front end (takes the KV blocks, generates the rest)")
    decode = start_frontend(procs, "decode-frontend", ckpt, monitor, ["--role", "decode"])
    say("5. starting the router (the OpenAI API in front of both)")
    # every prompt through the split: the demo shows the hand-off (docs/router.md)
    args = ["router", "--checkpoint", ckpt, "--model-name", "tiny", "--port", "0"]
    args += ["--max-local-prefill-tokens", "0"]
    router = start(procs, "router", [*args, "--prefill", prefill, "--decode", decode])
    say(f"   router {router.ready['name']} at {router.url}")
    return router.url, {"prefill": prefill, "decode": decode}


def run(args: argparse.Namespace) -> int:
    device = getattr(args, "device", "cpu")
    on_gpu = device.startswith("cuda")
    pd = getattr(args, "pd", False)
    if pd and (args.stages > 1 or on_gpu):
        # the roles need the front end's paged block pool in its own process on the CPU path
        # (frontend_cmd refuses --role otherwise): say so before anything starts
        raise SystemExit("moecomm demo --pd: works with --stages 1 and --device cpu only")
    if on_gpu:
        from moecomm_serving.cli.device import require_gpu

        require_gpu("moecomm demo")
        if args.stages > 1:
            raise SystemExit(
                "moecomm demo --device cuda: pipeline stages are not on the GPU path yet"
            )
    gpu = ["--device", device] if on_gpu else []
    interrupted = False

    def on_signal(*_):
        raise KeyboardInterrupt

    # SIGINT too, explicitly: a demo started in the background of a script inherits SIGINT
    # ignored, and Python then installs no KeyboardInterrupt handler of its own.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # --pd has one step more (the router) before the prompts
    step = 1 if pd else 0
    procs = None
    try:
        with tempfile.TemporaryDirectory(prefix="moecomm-demo-") as tmp:
            # the children's logs and ready files
            # with --pd, every child holds the deployment's secret (in its environment, not
            # argv): the front ends' /pd routes take it, the router sends it
            env = {**os.environ, PD_SECRET_ENV: generate()} if pd else None
            procs = Processes(os.path.join(tmp, "procs"), env=env, cli=CLI)
            ckpt = os.path.join(tmp, "tiny")
            arch = getattr(args, "arch", "mixtral")
            say(f"1. writing the tiny {arch} checkpoint (4 layers, 16 experts, hidden 256)")
            subprocess.run(
                [*CLI, "tiny", "--out", ckpt, "--arch", arch],
                check=True,
                timeout=CHILD_START_TIMEOUT_S,
            )
            say("2. starting the membership monitor")
            # `moecomm monitor` from its own module: no import of every command (torch included)
            monitor = start(procs, "monitor", [], argv=[*MONITOR_CMD]).url
            say(f"   monitor at {monitor}")
            server_urls = start_expert_servers(procs, ckpt, monitor, gpu)
            stages = args.stages
            if pd:
                url, fe_urls = start_pd(procs, ckpt, monitor)
            else:
                if stages > 1:
                    say(
                        f"4. starting the front end: {stages} pipeline stages, each a client "
                        "of the servers"
                    )
                else:
                    say("4. starting the front end (finds the servers through the monitor)")
                url = start_frontend(
                    procs, "frontend", ckpt, monitor, ["--stages", str(stages), *gpu]
                )
            health = httpx.get(f"{url}/health", timeout=HTTP_TIMEOUT_S).json()
            what = (
                "the router's view of each front end"
                if pd
                else "a real one-token forward through the expert servers"
            )
            say(f"{5 + step}. health ({what}): {health}")
            through = " through the router" if pd else ""
            say(
                f"{6 + step}. completions{through} (greedy, 16 tokens each; the tiny model is "
                "random, so is its text)"
            )
            for prompt in PROMPTS:
                text, s = complete(url, prompt)
                say(f"   {prompt!r} -> {text!r}  ({s * 1e3:.0f} ms)")
            say(f"   streamed chat (sampled, seed 7): {stream_chat(url, 'Hello experts')!r}")
            for i, server_url in enumerate(server_urls):
                load = httpx.get(f"{server_url}/experts", timeout=HTTP_TIMEOUT_S)
                say(
                    f"   expert server {i} served {sum(x['tokens'] for x in load.json()['load'])} "
                    "token copies"
                )
            if pd:
                say(f"{7 + step}. router metrics (latencies as its clients see them; hand-offs)")
                for ln in metric_summary(url):
                    say(f"   {ln}")
                for ln in pd_metric_lines(url, "moecomm_router_"):
                    say(f"   {ln}")
                for role, fe_url in fe_urls.items():
                    say(f"   {role} front end:")
                    for ln in pd_metric_lines(fe_url, "moecomm_kv_handoff_"):
                        say(f"     {ln}")
            else:
                say("7. front-end metrics")
                for ln in metric_summary(url):
                    say(f"   {ln}")
                if stages > 1:
                    # The standby stages start in the background while the prompts run; a
                    # front end stops once they are up, so the demo lets them come up first.
                    fe = procs["frontend"]
                    ready = fe.wait_output(STANDBY_READY, 1, CHILD_START_TIMEOUT_S)[0]
                    say(f"   {ready}")
    except KeyboardInterrupt:
        interrupted = True
        say("interrupted: shutting down")
    finally:
        say(f"{8 + step}. shutting down")
        if procs is not None:
            stop_all(procs)
    say("demo " + ("interrupted" if interrupted else "OK"))
    return 130 if interrupted else 0
