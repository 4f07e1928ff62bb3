"""A vLLM 0.33.0 instance without a model, in a process of its own, for the KV connector's
contract tests (test_vllm_kv_connector.py): vLLM's own ``Scheduler`` (which loads
``moecomm.engines.vllm_kv`` through ``kv_connector_module_path``, as ``vllm serve`` does), the
worker-side connector made by vLLM's ``KVConnectorFactory``, KV caches allocated by vLLM's
``allocate_kv_cache`` on CPU from a ``KVCacheConfig`` made by vLLM's ``get_kv_cache_configs``,
and the handshake metadata passed from worker to scheduler as ``EngineCore`` does.

Each :func:`Instance.step` is one engine step in the order vLLM's engine core and model
runner call the connector: ``schedule`` (``build_connector_meta``) → ``bind_connector_metadata``
→ ``start_load_kv`` → the forward (here: each scheduled token's K/V written into its block,
values from the token, its position and the layer, then ``save_kv_layer`` per layer) →
``wait_for_save`` → ``get_transfer_results`` / ``get_block_ids_with_load_errors`` →
``clear_connector_metadata`` → ``update_from_output``. The only stand-in is the model: no
attention is computed and the sampled token is fixed.

The process obeys commands from the test over a pipe (:func:`main`) and keeps stepping while
vLLM's scheduler ``has_requests()`` (a prefill holding blocks for its decode included).
"""

from __future__ import annotations

import os
import signal
import time
import traceback

MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 3,
    "head_dim": 32,  # one of the CPU attention backend's head sizes
    "vocab_size": 256,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}
BLOCK = 16
MAX_LEN = 512  # tokens of one request: 32 blocks, which each instance's pool must hold
# KV cache blocks per instance: a prefill pool smaller than the decode pool, as in practice.
NUM_BLOCKS = {"kv_producer": 48, "kv_consumer": 64}
SAMPLED_TOKEN = 7  # what the stand-in model "samples"
# How long the command loop sleeps between steps when it has nothing to do.
IDLE_S = 0.005


def layer_names() -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(MODEL["num_hidden_layers"])]


class Instance:
    """One vLLM instance: scheduler, worker-side connector, KV caches."""

    def __init__(self, role: str, workdir: str, extra: dict, failure_policy: str):
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        import json

        import torch
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
        from vllm.v1.core.kv_cache_planning import (
            get_global_kv_cache_groups,
            get_kv_cache_configs,
        )
        from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        torch.set_num_threads(1)
        model_dir = os.path.join(workdir, "model")
        os.makedirs(model_dir, exist_ok=True)
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(MODEL, f)
        max_len = MAX_LEN
        config = VllmConfig(
            model_config=ModelConfig(
                model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=max_len
            ),
            cache_config=CacheConfig(block_size=BLOCK),
            device_config=DeviceConfig(device="cpu"),
            scheduler_config=SchedulerConfig(
                max_num_seqs=8,
                max_num_batched_tokens=max_len,
                max_model_len=max_len,
                is_encoder_decoder=False,
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector="MoecommConnector",
                kv_connector_module_path="moecomm.engines.vllm_kv",
                kv_role=role,
                kv_connector_extra_config=extra,
                kv_load_failure_policy=failure_policy,
            ),
        )
        spec = FullAttentionSpec(
            block_size=BLOCK,
            num_kv_heads=MODEL["num_key_value_heads"],
            head_size=MODEL["head_dim"],
            dtype=torch.float32,
        )
        specs = {name: spec for name in layer_names()}
        # The engine core's layout resolution, from what vLLM's CPU attention backend supports.
        layouts = [layout.name for layout in CPUAttentionBackend.supported_kv_cache_layouts()]
        layout = resolve_kv_cache_layout(config, [layouts], specs.values())
        groups = get_global_kv_cache_groups(config, [specs])
        memory = NUM_BLOCKS[role] * spec.page_size_bytes * len(specs)
        # As EngineCore._initialize_kv_caches does.
        (kv_cache_config,) = get_kv_cache_configs(config, [specs], [memory], groups)
        kv_cache_config.kv_cache_layout = config.cache_config.kv_cache_layout
        scheduler_kv_cache_config = generate_scheduler_kv_cache_config([kv_cache_config])
        config.cache_config.num_gpu_blocks = scheduler_kv_cache_config.num_blocks
        self.num_blocks = kv_cache_config.num_blocks
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=scheduler_kv_cache_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
        )
        self.connector = KVConnectorFactory.create_connector(
            config, KVConnectorRole.WORKER, kv_cache_config
        )
        self.caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)
        self.connector.register_kv_caches(self.caches)
        # EngineCore._set_kv_connector_handshake_metadata: workers' metadata, keyed
        # (pp_rank, tp_rank), to the scheduler's connector.
        self.scheduler.get_kv_connector().set_xfer_handshake_metadata_pp_aware(
            {(0, 0): self.connector.get_handshake_metadata()}
        )
        self.outputs: dict[str, dict] = {}  # finished requests: their outputs
        self.loaded: dict[str, bytes] = {}  # decode: KV of a request as its load completed
        self.events: list[tuple[str, str]] = []  # (what, request id), in order

    # -- requests
    def add(self, req_id: str, prompt: list[int], max_tokens: int, params: dict | None) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        if params is not None:
            sp.extra_args = {"kv_transfer_params": params}
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=sp,
            pooling_params=None,
            block_hasher=get_request_block_hasher(BLOCK, sha256),
        )
        self.scheduler.add_request(request)

    def block_ids(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def kv_bytes(self, blocks: list[int], num_tokens: int) -> bytes:
        """The K/V of the first `num_tokens` tokens held in `blocks`, every layer, as bytes."""
        import torch

        out = []
        for name in layer_names():
            cache = self.caches[name]  # [blocks, heads, tokens, K|V]
            idx = torch.tensor(blocks, dtype=torch.long)
            tokens = cache.index_select(0, idx).transpose(1, 2).flatten(0, 1)  # [tok, H, C]
            out.append(tokens[:num_tokens].contiguous().view(torch.uint8).numpy().tobytes())
        return b"".join(out)

    # -- one engine step
    def _forward(self, out) -> dict[str, int]:
        """The model's stand-in: each scheduled token's K/V written into its block; returns
        the requests that produce a token this step."""
        import torch

        sampled = {}
        # Where each request's scheduled tokens start (the scheduler already counts them).
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, n in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            start = starts[req_id]
            tokens = request.all_token_ids
            blocks = self.block_ids(req_id)
            for li, name in enumerate(layer_names()):
                cache = self.caches[name]
                for pos in range(start, start + n):
                    value = float(tokens[pos] * 1000 + pos * 7 + li * 13)
                    row = value + torch.arange(cache.shape[-1], dtype=torch.float32) / 64
                    cache[blocks[pos // BLOCK], :, pos % BLOCK, :] = row
            if start + n >= request.num_prompt_tokens:
                sampled[req_id] = SAMPLED_TOKEN
        return sampled

    def step(self) -> int:
        """One engine step; returns the tokens it scheduled."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        c = self.connector
        c.bind_connector_metadata(out.kv_connector_metadata)
        c.start_load_kv(None)  # the forward context: unused by this connector
        sampled = self._forward(out)
        for name in layer_names():
            c.save_kv_layer(name, self.caches[name], None)
        c.wait_for_save()
        results = c.get_transfer_results(out.finished_req_ids)
        invalid = c.get_block_ids_with_load_errors()
        c.clear_connector_metadata()
        for req_id in results.finished_recving - results.failed_recving:
            # As the load completed, before any forward of the request on this side.
            request = self.scheduler.requests[req_id]
            blocks = self.block_ids(req_id)
            self.loaded[req_id] = self.kv_bytes(blocks, request.num_prompt_tokens)
        for what, ids in (
            ("sent", results.finished_sending),
            ("received", results.finished_recving - results.failed_recving),
            ("failed", results.failed_recving),
        ):
            self.events += [(what, r) for r in sorted(ids)]
        if invalid:
            self.events.append(("invalid_blocks", ",".join(map(str, sorted(invalid)))))
        req_ids = list(out.num_scheduled_tokens)
        runner = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[sampled[r]] if r in sampled else [] for r in req_ids],
            kv_connector_output=KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                failed_recving=results.failed_recving,
                invalid_block_ids=invalid,
            ),
        )
        for outputs in self.scheduler.update_from_output(out, runner).values():
            for o in outputs.outputs:
                if o.finish_reason is not None:
                    request = self.scheduler.requests.get(o.request_id)
                    self.outputs[o.request_id] = {
                        "finish_reason": str(o.finish_reason),
                        "kv_transfer_params": o.kv_transfer_params,
                        "blocks": self.block_ids(o.request_id) if request else None,
                    }
                    self.events.append(("finished", o.request_id))
        return out.total_num_scheduled_tokens

    def busy(self) -> bool:
        return self.scheduler.has_requests()


def main(role: str, workdir: str, extra: dict, failure_policy: str, conn) -> None:
    """The instance's process: build, then obey the test's commands, stepping in between."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import engine_env

    engine_env.activate()
    try:
        inst = Instance(role, workdir, extra, failure_policy)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    worked = 0
    while True:
        # Back to back while tokens are being computed; otherwise a short sleep between steps
        # (a prefill holding blocks for its decode keeps vLLM stepping with nothing to run).
        if conn.poll(0 if worked else IDLE_S):
            cmd, args = conn.recv()
            try:
                if cmd == "stop":
                    inst.connector.shutdown()
                    conn.send(("ok", None))
                    return
                conn.send(("ok", COMMANDS[cmd](inst, *args)))
            except BaseException:
                conn.send(("error", traceback.format_exc()))
        worked = inst.step() if inst.busy() else 0


def _add(inst: Instance, req_id, prompt, max_tokens, params):
    inst.add(req_id, prompt, max_tokens, params)


def _output(inst: Instance, req_id):
    return inst.outputs.get(req_id)


def _prefill_kv(inst: Instance, req_id, num_tokens):
    """The prefill's KV of a finished request (its blocks are held for the decode)."""
    return inst.kv_bytes(inst.outputs[req_id]["blocks"], num_tokens)


def _loaded(inst: Instance, req_id):
    return inst.loaded.get(req_id)


def _events(inst: Instance):
    return list(inst.events)


def _free_blocks(inst: Instance):
    return inst.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def _die_mid_send(inst: Instance, after_layers):
    """Fault injection for the kill test: this process SIGKILLs itself inside its next KV
    send, after `after_layers` layers were written into the decode's pool."""
    from moecomm.wire import kv

    real = kv.KvSend.layer

    def layer(self, i):
        real(self, i)
        if len(self.done_layers) >= after_layers:
            os.kill(os.getpid(), signal.SIGKILL)

    kv.KvSend.layer = layer


def _pause_mid_send(inst: Instance, after_layers, go):
    """The next KV send stops after `after_layers` layers: it writes `go`.paused, then waits
    (60 s at most) for `go` to exist before it goes on (the test kills the decode meanwhile)."""
    from moecomm.wire import kv

    real = kv.KvSend.layer

    def layer(self, i):
        real(self, i)
        if len(self.done_layers) == after_layers:
            open(go + ".paused", "w").close()
            wait_until(lambda: os.path.exists(go), 60.0, f"{go} to exist")

    kv.KvSend.layer = layer


def _staged(inst: Instance):
    return inst.connector.worker.staged


COMMANDS = {
    "add": _add,
    "output": _output,
    "prefill_kv": _prefill_kv,
    "loaded": _loaded,
    "events": _events,
    "free_blocks": _free_blocks,
    "die_mid_send": _die_mid_send,
    "pause_mid_send": _pause_mid_send,
    "staged": _staged,
}


def wait_until(fn, timeout: float, what: str, poll: float = 0.02):
    """`fn()` once it is truthy; TimeoutError naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout:.0f} s")
        time.sleep(poll)
