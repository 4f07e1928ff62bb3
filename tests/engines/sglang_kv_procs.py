"""SGLang 0.5.23's PD-disaggregation transfer flow on the moecomm backend
(moecomm.engines.sglang_kv), in two rank processes: rank 0 is a prefill scheduler rank, rank 1
a decode scheduler rank (test_sglang_kv_backend.py checks outcomes).

What is SGLang's own code here:
- the registration: SGLang's CLI parser (``ServerArgs.add_cli_args``) accepting
  ``--disaggregation-transfer-backend moecomm``, ``ServerArgs`` built from it, and the classes
  resolved by ``TransferBackend(name)`` and ``get_kv_class`` through the bindings prefill.py,
  decode.py and disagg_service.py hold;
- the bootstrap server started by SGLang's ``start_disagg_service()`` on the prefill;
- the KV memory: SGLang's ``MHATokenToKVPool`` on CPU (its ``get_contiguous_buf_infos`` gives
  the pointers, as prefill.py/decode.py pass them in ``KVArgs``) and its ``MetadataBuffers``
  (the aux buffers: the first output token travels in them);
- the polling: SGLang's ``poll_and_all_reduce`` (the function the prefill bootstrap/inflight
  queues and the decode queues call), over a one-rank gloo group per side.

The queues themselves (``PrefillBootstrapQueue``, ``DecodePreallocQueue``, ...) need a whole
scheduler (model runner, radix tree, allocator); ``Prefill``/``Decode`` below make the calls
they make, in their order, with their branches on each ``KVPoll`` state: prefill ``sender(...)``
-> poll until WaitingForInput -> ``init(num_pages, aux_index)`` -> ``send`` per chunk -> poll
until Success, or Failed -> ``failure_exception()`` in a try (handle_inflight_transfer_failure);
decode ``receiver(...)`` -> ``try_ensure_parallel_info`` / ``prefill_info_table`` ->
``init(dp_rank)`` -> poll until WaitingForInput -> ``send_metadata(pages, aux_index)`` -> poll
until Success or Failed -> ``failure_exception()`` (pop_transferred) -> ``clear()``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
import urllib.error
import urllib.request

import torch
import torch.distributed as dist
from moecomm.errors import PeerLostError, RemoteError
from moecomm.wire.kv import BlockTransferError

PREFILL, DECODE = 0, 1
PAGE = 4  # tokens per page
LAYERS = 3
HEADS = 2
HEAD_DIM = 16
PREFILL_TOKENS = 96  # the prefill's pool: 24 pages (+1 SGLang keeps for padding)
DECODE_TOKENS = 160  # the decode's: larger, as usual
META_SLOTS = 8
SEED = 39
# SGLang's two deadlines, short here so that a failure the backend missed ends the scenario
# (a scenario's own deadline, below, is shorter than rank_group's 90 s).
SGLANG_TIMEOUT_S = 20
POLL_DEADLINE_S = 30.0
POLL_PERIOD_S = 0.002
# A killed peer must be reported within this (the liveness read of one poll, plus scheduling
# on a loaded 2-core machine).
FAILURE_DEADLINE_S = 10.0

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": HEADS * HEAD_DIM * 2,
    "intermediate_size": 128,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS * 2,
    "num_key_value_heads": HEADS,
    "head_dim": HEAD_DIM,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "torch_dtype": "bfloat16",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_args(ctx, port: int):
    """SGLang's ServerArgs, from its own CLI parser, as `sglang.launch_server` builds them."""
    from sglang.srt.server_args import ServerArgs

    model = os.path.join(ctx.workdir, f"tiny-{ctx.rank}")
    os.makedirs(model, exist_ok=True)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(TINY_CONFIG, f)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    mode = "prefill" if ctx.rank == PREFILL else "decode"
    ns = parser.parse_args(
        [
            "--model-path", model,
            "--device", "cpu",
            "--skip-tokenizer-init",
            "--disaggregation-mode", mode,
            "--disaggregation-transfer-backend", "moecomm",
            "--disaggregation-bootstrap-port", str(port),
        ]
    )  # fmt: skip
    return ServerArgs.from_cli_args(ns)


def setup(ctx) -> None:
    os.environ["SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"] = str(SGLANG_TIMEOUT_S)
    os.environ["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] = str(SGLANG_TIMEOUT_S)
    os.environ["MOECOMM_SGLANG_KV_TOKEN"] = TOKEN  # the deployment's secret, both sides
    from moecomm.engines import sglang_kv

    sglang_kv.register()
    port = [_free_port() if ctx.rank == PREFILL else 0]
    dist.broadcast_object_list(port, src=PREFILL, group=ctx.group)
    ctx.state["port"] = port[0]
    # One-rank groups: each side polls as a TP group of one (every rank makes every group).
    groups = [dist.new_group([r], backend="gloo") for r in range(ctx.num_ranks)]
    ctx.state["own_group"] = groups[ctx.rank]
    ctx.state["server_args"] = _server_args(ctx, port[0])


def teardown(ctx) -> None:
    mgr = ctx.state.pop("manager", None)
    if mgr is not None:
        mgr.close()
    server = ctx.state.pop("bootstrap", None)
    if server is not None:
        server.close()


# ---------------------------------------------------------------------------------------------
# The engine side: SGLang's pools, KVArgs as prefill.py/decode.py fill them
# ---------------------------------------------------------------------------------------------


def _engine(ctx):
    from sglang.srt.disaggregation.utils import MetadataBuffers
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    tokens = PREFILL_TOKENS if ctx.rank == PREFILL else DECODE_TOKENS
    kv = MHATokenToKVPool(
        size=tokens,
        page_size=PAGE,
        dtype=torch.bfloat16,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    meta = MetadataBuffers(
        META_SLOTS, hidden_size=64, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=4
    )
    return kv, meta


def _kv_args(ctx, kv, meta):
    """KVArgs filled as PrefillBootstrapQueue._init_kv_manager / DecodePreallocQueue's do."""
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    backend = TransferBackend(ctx.state["server_args"].disaggregation_transfer_backend)
    args = get_kv_class(backend, KVClassType.KVARGS)()
    args.engine_rank = 0
    args.pp_rank = 0
    args.system_dp_rank = 0
    args.kv_cache_dtype_str = "bfloat16"
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = kv.get_contiguous_buf_infos()
    args.kv_head_num = HEADS
    args.total_kv_head_num = HEADS
    args.page_size = PAGE
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = meta.get_buf_infos()
    args.state_types, args.state_data_ptrs = [], []
    args.state_data_lens, args.state_item_lens = [], []
    args.ib_device = None
    args.gpu_id = 0
    return args


def page_bytes(kv) -> list[torch.Tensor]:
    """Every KV buffer of SGLang's pool as ``[pages, page bytes]`` (a view, not a copy)."""
    from moecomm.engines.sglang_kv import host_tensor

    ptrs, lens, items = kv.get_contiguous_buf_infos()
    return [host_tensor(p, n).view(n // i, i) for p, n, i in zip(ptrs, lens, items, strict=True)]


def reference(kv_prefill_shapes) -> list[torch.Tensor]:
    """The prefill's KV (seeded random bytes), which the decode rebuilds to check against."""
    g = torch.Generator().manual_seed(SEED)
    return [torch.randint(0, 256, s, generator=g, dtype=torch.uint8) for s in kv_prefill_shapes]


def setup_engine(ctx) -> None:
    """Both ranks: SGLang's pools, the manager (SGLang's classes through get_kv_class) and, on
    the prefill, the bootstrap server SGLang's start_disagg_service starts."""
    from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend
    from sglang.srt.managers import disagg_service
    from sglang.srt.runtime_context import publish

    sa = ctx.state["server_args"]
    publish(sa, role="scheduler")
    kv, meta = _engine(ctx)
    ctx.state["kv"], ctx.state["meta"] = kv, meta
    shapes = [(PREFILL_TOKENS // PAGE + 1, t.shape[1]) for t in page_bytes(kv)]
    ctx.state["ref"] = reference(shapes)
    if ctx.rank == PREFILL:
        ctx.state["bootstrap"] = disagg_service.start_disagg_service()
        for t, r in zip(page_bytes(kv), ctx.state["ref"], strict=True):
            t.copy_(r)
    backend = TransferBackend(sa.disaggregation_transfer_backend)
    manager_cls = disagg_service.get_kv_class(backend, KVClassType.MANAGER)
    mode = DisaggregationMode.PREFILL if ctx.rank == PREFILL else DisaggregationMode.DECODE
    ctx.state["manager"] = manager_cls(_kv_args(ctx, kv, meta), mode, sa, False)


# ---------------------------------------------------------------------------------------------
# The queues' calls
# ---------------------------------------------------------------------------------------------


def _poll(ctx, pollers) -> list[int]:
    from sglang.srt.disaggregation.utils import poll_and_all_reduce

    return poll_and_all_reduce(pollers, ctx.state["own_group"])


def poll_until(ctx, poller, wanted: set[int], deadline_s: float = POLL_DEADLINE_S) -> int:
    """Polls as the queues do, once per scheduler iteration, until a state in `wanted`."""
    deadline = time.monotonic() + deadline_s
    while True:
        (state,) = _poll(ctx, [poller])
        if state in wanted:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"poll stayed at {state}, not {sorted(wanted)}, {deadline_s} s")
        time.sleep(POLL_PERIOD_S)


def failure_of(poller) -> Exception:
    """What the queues log on KVPoll.Failed: failure_exception() raised in a try."""
    try:
        poller.failure_exception()
    except Exception as exc:  # the queues catch any exception here
        return exc
    raise AssertionError("failure_exception() did not raise")


def _cls(ctx, kind: str):
    from sglang.srt.disaggregation import decode, prefill
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend

    backend = TransferBackend(ctx.state["server_args"].disaggregation_transfer_backend)
    if kind == "sender":
        return prefill.get_kv_class(backend, KVClassType.SENDER)
    return decode.get_kv_class(backend, KVClassType.RECEIVER)


def bootstrap_addr(ctx) -> str:
    return f"127.0.0.1:{ctx.state['port']}"


class Prefill:
    """One request on the prefill: bootstrap, then the chunks, as the queues call them."""

    def __init__(self, ctx, room: int):
        from sglang.srt.disaggregation.base.conn import KVPoll

        self.ctx, self.KVPoll = ctx, KVPoll
        self.sender = _cls(ctx, "sender")(
            mgr=ctx.state["manager"], bootstrap_addr=bootstrap_addr(ctx), bootstrap_room=room
        )

    def bootstrap(self, num_pages: int, aux_index: int) -> None:
        P = self.KVPoll
        state = poll_until(self.ctx, self.sender, {P.WaitingForInput, P.Failed})
        assert state == P.WaitingForInput, failure_of(self.sender)
        self.sender.init(num_pages, aux_index)

    def send(self, pages: list[int]) -> None:
        import numpy as np

        self.sender.send(np.asarray(pages, dtype=np.int32))

    def finish(self, deadline_s: float = POLL_DEADLINE_S) -> int:
        P = self.KVPoll
        state = poll_until(self.ctx, self.sender, {P.Success, P.Failed}, deadline_s)
        if state == P.Success:
            self.sender.clear()
        return state


class Decode:
    """One request on the decode: bootstrap, reserve and publish its pages, wait."""

    def __init__(self, ctx, room: int):
        from sglang.srt.disaggregation.base.conn import KVPoll

        self.ctx, self.KVPoll = ctx, KVPoll
        mgr = ctx.state["manager"]
        self.receiver = _cls(ctx, "receiver")(
            mgr=mgr, bootstrap_addr=bootstrap_addr(ctx), bootstrap_room=room
        )
        # DecodePreallocQueue: the prefill's parallel info first (retried by the queue), then
        # the prefill dp rank from prefill_info_table (dp_size 1 -> 0).
        deadline = time.monotonic() + POLL_DEADLINE_S
        while not mgr.try_ensure_parallel_info(bootstrap_addr(ctx)):
            assert time.monotonic() < deadline, "the prefill never registered"
            time.sleep(0.05)
        info = mgr.prefill_info_table[bootstrap_addr(ctx)]
        assert info.dp_size == 1 and info.follow_bootstrap_room
        self.receiver.init(0)

    def publish(self, pages: list[int], aux_index: int) -> None:
        import numpy as np

        P = self.KVPoll
        state = poll_until(self.ctx, self.receiver, {P.WaitingForInput, P.Failed})
        assert state == P.WaitingForInput, failure_of(self.receiver)
        self.receiver.send_metadata(np.asarray(pages, dtype=np.int32), aux_index)

    def finish(self, deadline_s: float = POLL_DEADLINE_S) -> int:
        P = self.KVPoll
        state = poll_until(self.ctx, self.receiver, {P.Success, P.Failed}, deadline_s)
        self.receiver.clear()
        return state


# ---------------------------------------------------------------------------------------------
# Scenarios
# ---------------------------------------------------------------------------------------------

# (room, prefill pages, decode pages, chunk sizes): contiguous, scattered, chunked like a chunked
# prefill (SGLang sends each chunk's pages as it is computed), one page.
REQUESTS = [
    (1001, [1, 2, 3, 4], [10, 11, 12, 13], [4]),
    (1002, [7, 3, 20, 5, 6], [2, 30, 31, 8, 9], [2, 3]),
    (1003, list(range(8, 20)), list(range(16, 28)), [5, 5, 2]),
    (1004, [23], [39], [1]),
]
TOKEN = "sglang-kv-test-secret"
FIRST_TOKEN = 117  # what the prefill's metadata row says was sampled first


def scenario_registration(ctx) -> None:
    """`moecomm` resolves through SGLang's own lookups; the built-in backends still do."""
    from moecomm.engines import sglang_kv
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
    from sglang.srt.disaggregation import decode, prefill
    from sglang.srt.disaggregation.fake import FakeKVManager
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend
    from sglang.srt.managers import disagg_service

    assert "moecomm" in DISAGG_TRANSFER_BACKEND_CHOICES
    assert ctx.state["server_args"].disaggregation_transfer_backend == "moecomm"
    backend = TransferBackend("moecomm")
    assert backend is TransferBackend.MOECOMM and backend in list(TransferBackend)
    want = {
        KVClassType.MANAGER: sglang_kv.MoecommKVManager,
        KVClassType.SENDER: sglang_kv.MoecommKVSender,
        KVClassType.RECEIVER: sglang_kv.MoecommKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: sglang_kv.MoecommKVBootstrapServer,
    }
    for module in (prefill, decode, disagg_service):
        for kind, cls in want.items():
            got = module.get_kv_class(backend, kind)
            assert got is cls, f"{module.__name__}.get_kv_class(moecomm, {kind}) -> {got}"
        assert module.get_kv_class(TransferBackend.FAKE, KVClassType.MANAGER) is FakeKVManager
    sglang_kv.register()  # twice: nothing changes
    assert list(TransferBackend).count(TransferBackend.MOECOMM) == 1
    assert DISAGG_TRANSFER_BACKEND_CHOICES.count("moecomm") == 1
    assert not disagg_service.rust_server_serves_kv_bootstrap("moecomm")
    setup_engine(ctx)
    dist.barrier(group=ctx.group)  # the prefill's bootstrap server and listener are up
    # Without the deployment's secret (or with another), the bootstrap server and the prefill's
    # listener refuse.
    if ctx.rank == DECODE:
        url = f"http://{bootstrap_addr(ctx)}/moecomm/prefill?dp_rank=0&engine_rank=0"
    else:
        url = ctx.state["manager"].endpoint + "/moecomm/transfer"
    for header in (None, "Bearer not-the-secret", TOKEN, f"Bearer {TOKEN}"):
        req = urllib.request.Request(url, data=b"{}", method="GET" if ctx.rank else "POST")
        if header is not None:
            req.add_header("authorization", header)
        try:
            urllib.request.urlopen(req, timeout=5).close()
            status = 200
        except urllib.error.HTTPError as exc:
            status = exc.code
        assert (status == 401) == (header != f"Bearer {TOKEN}"), (header, status)


def scenario_transfer(ctx) -> None:
    """Four requests in flight at once, chunked and scattered: the decode's pages bit-exact,
    the metadata row (first token) through, the sender's metric counting the bytes."""
    kv, meta = ctx.state["kv"], ctx.state["meta"]
    if ctx.rank == PREFILL:
        reqs = [(Prefill(ctx, room), src, chunks) for room, src, _, chunks in REQUESTS]
        for i, (p, src, _) in enumerate(reqs):
            meta.output_ids[i][0] = FIRST_TOKEN + i
            p.bootstrap(len(src), i)
        for p, src, chunks in reqs:
            at = 0
            for n in chunks:
                p.send(src[at : at + n])
                at += n
        for p, src, _ in reqs:
            assert p.finish() == p.KVPoll.Success, failure_of(p.sender)
            metric = p.sender.get_transfer_metric()
            assert metric.transfer_total_bytes == len(src) * sum(t.shape[1] for t in page_bytes(kv))
        return
    reqs = [(Decode(ctx, room), src, dst) for room, src, dst, _ in REQUESTS]
    for i, (d, _, dst) in enumerate(reqs):
        meta.output_ids[META_SLOTS - 1 - i][0] = 0
        d.publish(dst, META_SLOTS - 1 - i)
    for i, (d, src, dst) in enumerate(reqs):
        state = d.finish()
        assert state == d.KVPoll.Success, failure_of(d.receiver)
        for buf, (got, want) in enumerate(zip(page_bytes(kv), ctx.state["ref"], strict=True)):
            assert torch.equal(got[dst], want[src]), f"room {d.receiver.bootstrap_room} buf {buf}"
        assert int(meta.output_ids[META_SLOTS - 1 - i][0]) == FIRST_TOKEN + i
    # The pages no request named are untouched (zeros, as SGLang allocated them).
    named = sorted({p for _, _, dst, _ in REQUESTS for p in dst})
    others = [p for p in range(DECODE_TOKENS // PAGE + 1) if p not in named]
    assert all(int(t[others].count_nonzero()) == 0 for t in page_bytes(kv))


def scenario_bad_indices(ctx) -> None:
    """A prefill page out of range: Failed on both sides, naming it; a decode page out of range:
    Failed on the decode at send_metadata, before anything is asked of the prefill."""
    if ctx.rank == PREFILL:
        p = Prefill(ctx, 2001)
        p.bootstrap(2, 0)
        p.send([3, PREFILL_TOKENS // PAGE + 5])
        assert p.finish() == p.KVPoll.Failed
        exc = failure_of(p.sender)
        assert isinstance(exc, BlockTransferError) and "source block" in str(exc), exc
        assert "out of range" in exc.failure_reason and exc.bootstrap_room == 2001, exc
        assert exc.is_from_another_rank is False
        return
    d = Decode(ctx, 2001)
    d.publish([4, 5], 0)
    assert d.finish(FAILURE_DEADLINE_S) == d.KVPoll.Failed
    exc = failure_of(d.receiver)
    # The prefill's refusal, with its reason, left in the decode's slot.
    assert isinstance(exc, RemoteError) and "source block" in str(exc), exc
    assert "out of range" in str(exc) and exc.bootstrap_room == 2001, exc
    bad = Decode(ctx, 2002)
    bad.publish([1, DECODE_TOKENS], 1)
    (state,) = _poll(ctx, [bad.receiver])
    assert state == bad.KVPoll.Failed
    exc = failure_of(bad.receiver)
    assert isinstance(exc, BlockTransferError), exc
    assert "destination block" in str(exc) and "out of range" in str(exc), exc


def scenario_prefill_killed(ctx) -> None:
    """The prefill dies after its first chunk: the decode's poll says Transferring, then Failed
    within FAILURE_DEADLINE_S, and failure_exception names the dead prefill. Last: the prefill
    rank is killed when this scenario ends."""
    ctx.state["group_broken"] = True
    room, src, dst = 3001, list(range(0, 8)), list(range(0, 8))
    seen = os.path.join(ctx.workdir, "decode-saw-transferring")
    if ctx.rank == PREFILL:
        p = Prefill(ctx, room)
        p.bootstrap(len(src), 0)
        p.send(src[:3])
        # Killed only once the decode saw the first chunk land (else it could see the death
        # before any page and the scenario would not be "mid-transfer").
        deadline = time.monotonic() + POLL_DEADLINE_S
        while not os.path.exists(seen):
            assert time.monotonic() < deadline, "the decode never saw Transferring"
            time.sleep(0.01)
        ctx.state["die"] = True
        return
    d = Decode(ctx, room)
    d.publish(dst, 0)
    poll_until(ctx, d.receiver, {d.KVPoll.Transferring})
    open(seen, "w").close()
    t0 = time.monotonic()
    state = poll_until(ctx, d.receiver, {d.KVPoll.Failed, d.KVPoll.Success}, FAILURE_DEADLINE_S)
    assert state == d.KVPoll.Failed, "Success although the prefill died mid-transfer"
    exc = failure_of(d.receiver)
    assert isinstance(exc, PeerLostError) and "prefill process died" in str(exc), exc
    ctx.state["failed_after_s"] = time.monotonic() - t0


def scenario_decode_killed(ctx) -> None:
    """The decode dies after publishing its pages: the prefill's poll says Failed within
    FAILURE_DEADLINE_S (SGLang's inflight queue then concludes it), naming the dead decode."""
    ctx.state["group_broken"] = True
    room = 4001
    if ctx.rank == DECODE:
        d = Decode(ctx, room)
        d.publish([1, 2, 3], 0)
        ctx.state["die"] = True
        return
    p = Prefill(ctx, room)
    P = p.KVPoll
    # The decode is killed as soon as its request is posted: the prefill may see the request
    # and the death in one poll (Failed at once) or the request first (WaitingForInput, then
    # init as PrefillBootstrapQueue does, then Failed while the request waits for its forward
    # pass); either way within the deadline and never Success.
    state = poll_until(ctx, p.sender, {P.WaitingForInput, P.Failed}, POLL_DEADLINE_S)
    if state == P.WaitingForInput:
        p.sender.init(3, 0)
    state = poll_until(ctx, p.sender, {P.Failed, P.Success}, FAILURE_DEADLINE_S)
    assert state == P.Failed
    p.send([1, 2, 3])  # after Failed: nothing is written, nothing raises
    exc = failure_of(p.sender)
    assert isinstance(exc, PeerLostError) and "decode process died" in str(exc), exc


SCENARIOS = {
    "registration": scenario_registration,
    "transfer": scenario_transfer,
    "bad_indices": scenario_bad_indices,
    "prefill_killed": scenario_prefill_killed,
    "decode_killed": scenario_decode_killed,
}
# Each group ends with one kill: two groups.
GROUP_PREFILL_DIES = ["registration", "transfer", "bad_indices", "prefill_killed"]
GROUP_DECODE_DIES = ["registration", "decode_killed"]
