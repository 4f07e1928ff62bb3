"""The CUDA path's Python glue (regions, peer bases, configs, workspace offsets, the gather's
entry states, the response rings seen through as_strided, the statuses) driven by stand-in
kernels that read and write the same host memory the real ones would read and write on the
device, at the offsets of the real workspace layouts (moecomm._cuda's, host-only functions).
Request payloads travel out of band (the glue never reads a request slot); everything the glue
reads is where the real kernels put it. Ranks are threads of this process."""

from __future__ import annotations

import ctypes
import time
import types
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext

import moecomm
import pytest
import torch
import torch.distributed as dist
from moecomm._C import Encoding
from moecomm.compat.deep_ep import Buffer
from moecomm.compat.low_latency import device as ll_device
from moecomm.compat.low_latency.cast import deepep_cast, logfmt_roundtrip, pack_ue8m0
from moecomm.compat.low_latency.layout import COMBINE_SEQ_BASE
from moecomm.ops.reorg import reorganize
from moecomm.wire.protocol import SlotLayout
from test_deep_ep_device_host import FP8, E, H, K, L, M, R, _expert_output, _inputs, _source


def _mem(ptr: int, nbytes: int, dtype=torch.uint8) -> torch.Tensor:
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8).view(
        dtype
    )


class _Stream:
    cuda_stream = 0

    def __init__(self, device=None):
        self.device = device

    def wait_event(self, event):
        pass

    def __eq__(self, other):
        return isinstance(other, _Stream)

    __hash__ = object.__hash__


class _Event:
    def record(self, stream=None):
        pass


_FAKE_CUDA = types.SimpleNamespace(
    Event=_Event,
    current_stream=lambda device=None: _Stream(device),
    device=lambda d: nullcontext(),
    stream=lambda s: nullcontext(),
    synchronize=lambda d=None: None,
)


class _Kernels:
    """moecomm._cuda with the transport and the four launchers replaced (host memory)."""

    def preload_kernels(self, device):
        """The real module loads every kernel on `device` before the first launch (once per
        process and device: runtime/device_preload.py); the stand-in launchers need nothing."""
        self.preloaded.append(device)
        return {"device": device, "functions": 0, "loaded_now": 0, "seconds": 0.0, "how": "stub"}

    def __init__(self):
        self.preloaded = []  # devices the glue asked to preload, in order
        real = moecomm.wire.cuda.cuda_module(need_device=False)
        for name in ("ClientConfig", "DispatchArgs", "CombineArgs", "ServerConfig",
                     "ServerGatherArgs", "ServerRespondArgs", "IpcPeers", "SERVER_STATUS",
                     "client_workspace_layout", "server_workspace_layout"):  # fmt: skip
            setattr(self, name, getattr(real, name))
        self.regions, self.requests, self.responses = {}, {}, {}
        self.answered = []  # (client, response slot, seq) of every answer, in order
        self.drop_answers_to = None  # (client rank's region ptr): answers that never land
        kernels = self

        class Region:
            def __init__(self, n):
                self.t = torch.zeros(n, dtype=torch.uint8)
                self.device_ptr = self.t.data_ptr()
                self.handle = f"fake:{self.device_ptr}"
                kernels.regions[self.handle] = self

        class IpcTransport:
            def __init__(self, device=None):
                pass

            def create_region(self, n):
                return Region(n)

            def peer_alive(self, region):
                return True

        class IpcPeerTable:
            def __init__(self, transport, region, max_peers, streams):
                self.base = torch.zeros(max_peers, dtype=torch.int64)
                self.peers = []

            def add_peer(self, handle):
                self.peers.append(kernels.regions[handle])
                self.base[len(self.peers) - 1] = self.peers[-1].device_ptr
                return len(self.peers) - 1

            def backend(self):
                return {"peer_base": self.base.data_ptr()}

            def peer_region(self, index):
                return self.peers[index]

        self.IpcTransport, self.IpcPeerTable = IpcTransport, IpcPeerTable

    @staticmethod
    def _base(peers, p):
        return int(_mem(peers.peer_base, 8 * peers.max_peers, torch.int64)[p])

    @staticmethod
    def _layout(cfg):
        enc, out = Encoding(cfg.encoding), Encoding(cfg.out_encoding)
        return SlotLayout(cfg.max_tokens, cfg.hidden, cfg.topk, enc, out)

    def client_dispatch(self, peers, cfg, a, stream):
        nr, h, n, k = cfg.num_servers, cfg.hidden, a.num_tokens, a.topk
        lay, ws = self.client_workspace_layout(cfg), a.workspace
        assert a.ids_int64 and a.x_row_stride == h
        ids = _mem(a.topk_ids, 8 * n * k, torch.int64).view(n, k)
        quantized = a.x_dtype == int(FP8)  # already cast: bytes and scales sent as they are
        assert quantized == (cfg.encoding == int(FP8))  # the adapter never lets the kernel cast
        if quantized:
            x = _mem(a.x, n * h).view(n, h)
            x_scales = _mem(a.x_scales, 4 * n * (h // 128), torch.float32).view(n, h // 128)
        else:
            assert a.x_dtype == int(Encoding.BF16)
            x = _mem(a.x, 2 * n * h, torch.bfloat16).view(n, h)
        w = _mem(a.topk_weights, 4 * n * k, torch.float32).view(n, k)
        es = _mem(a.expert_server, 4 * a.num_experts, torch.int32).long()
        el = _mem(a.expert_local, 4 * a.num_experts, torch.int32)
        seqs = _mem(a.next_seq, 8 * nr, torch.int64)
        pos = _mem(ws + lay["pos"], 4 * cfg.max_tokens * nr, torch.int32).view(-1, nr)
        count = _mem(ws + lay["count"], 4 * nr, torch.int32)
        sent = _mem(ws + lay["sent_seq"], 8 * nr, torch.int64)
        req_off = _mem(cfg.request_ring_offset, 8 * nr, torch.int64)
        ok = (ids >= 0) & (ids < a.num_experts)
        server = torch.where(ok, es[ids.clamp(0, a.num_experts - 1)], -1)
        for s in range(nr):
            here = server == s
            rows = torch.nonzero(here.any(1)).squeeze(1)
            pos[:n, s] = -1
            pos[rows, s] = torch.arange(rows.numel(), dtype=torch.int32)
            count[s] = rows.numel()
            if not rows.numel():
                sent[s] = 0
                continue
            seqs[s] += 1
            sent[s] = seqs[s]
            acts, scales = x[rows].clone(), x_scales[rows].clone() if quantized else None
            local = torch.where(here, el[ids.clamp(0, a.num_experts - 1)], -1)[rows]
            key = (self._base(peers, s), int(req_off[s]), a.slot)
            self.requests[key] = {
                "client": cfg.client_id, "seq": int(seqs[s]), "layer": a.layer_id,
                "acts": acts, "scales": scales, "ids": local.to(torch.int32),
                "scores": torch.where(here, w, 0.0)[rows], "polls_left": 2,
                "stale": self.requests.pop(key, {}).get("seq"),
            }  # fmt: skip

    def server_gather(self, peers, cfg, ga, stream):
        nr, ns, ne = cfg.num_clients, cfg.num_slots, cfg.num_experts
        lay, ws = self.server_workspace_layout(cfg), ga.workspace
        req_off = _mem(cfg.request_ring_offset, 8 * nr, torch.int64)
        cids = _mem(cfg.client_ids, 8 * nr, torch.int64)
        entries = _mem(ws + lay["entries"], 32 * nr * ns, torch.int32).view(nr * ns, 8)
        entries.zero_()
        ids, scores, served = [], [], []
        for c in range(nr):
            for s in range(ns):
                key = (peers.local_base, int(req_off[c]), s)
                req = self.requests.get(key)
                if req is not None and req["polls_left"] > 0:  # still landing: next pass
                    # The request it replaces (never answered) shows meanwhile: first as a
                    # valid one of its older seq, then rejected (header already overwritten).
                    req["polls_left"] -= 1
                    if req["stale"] is not None:
                        act = 2 if req["polls_left"] == 0 else 1
                        entries[c * ns + s] = torch.tensor([act, 9, 0, 1, s, 0, req["stale"], 0])
                    req = None
                if req is None or req["layer"] != ga.layer_id:
                    ids.append(torch.empty(0, cfg.topk, dtype=torch.int32))
                    scores.append(torch.empty(0, cfg.topk))
                    continue
                assert req["client"] == int(cids[c])
                n = req["ids"].shape[0]
                seq = req["seq"]
                entries[c * ns + s] = torch.tensor([1, 0, n, cfg.topk, req["layer"], 0, seq, 0])
                ids.append(req["ids"])
                scores.append(req["scores"])
                served.append((c, s, key, req))
        lay_r = reorganize(ids, scores, ne)
        n = int(lay_r.offsets[-1])
        mr, rb = int(lay["max_rows"]), int(lay["row_bytes"])
        g = torch.Generator().manual_seed(n)

        def put(name, dtype, values, garbage_hi):
            part = _mem(ws + lay[name], mr * torch.empty((), dtype=dtype).element_size(), dtype)
            part.copy_(torch.randint(-3, garbage_hi, (mr,), generator=g).to(dtype))
            part[:n] = values.to(dtype)

        _mem(ws + lay["counts"], 4 * ne, torch.int32).copy_(lay_r.counts)
        _mem(ws + lay["offsets"], 8 * (ne + 1), torch.int64).copy_(lay_r.offsets)
        put("src_batch", torch.int32, lay_r.src_batch, 2 * nr * ns)
        put("src_token", torch.int64, lay_r.src_token, 1 << 20)
        put("row_scores", torch.float32, lay_r.scores, 1 << 10)
        rows = _mem(ws + lay["rows"], mr * rb).view(mr, rb)
        rows.copy_(torch.randint(0, 255, (mr, rb), generator=g, dtype=torch.uint8))
        _mem(ws + lay["batch_offsets"], 8 * (nr * ns + 1), torch.int64).copy_(lay_r.batch_offsets)
        slot_of = _mem(ws + lay["slot_of"], 8 * mr, torch.int64)
        slot_of.copy_(torch.randint(-3, 1 << 20, (mr,), generator=g))
        slot_of[: lay_r.slot_of.numel()] = lay_r.slot_of.reshape(-1)
        if served:
            acts = torch.cat([r["acts"] for *_, r in served])
            rows[:n] = acts.view(torch.uint8).view(acts.shape[0], rb)[lay_r.src_token]
            if served[0][3]["scales"] is not None:
                sc = torch.cat([r["scales"] for *_, r in served])
                spt = sc.shape[1]
                step = int(cfg.max_step_tokens)
                _mem(ws + lay["scales"], 4 * step * spt, torch.float32).view(step, spt)[
                    : sc.shape[0]
                ] = sc

    def server_respond(self, peers, cfg, ra, stream):
        """As the kernels: every serving entry of the workspace (its state, first step token,
        slot_of rows) answered into the response slot of its index, with its seq and layer."""
        nr, h, ns, topk = cfg.num_clients, cfg.hidden, cfg.num_slots, cfg.topk
        lay, ws = self.server_workspace_layout(cfg), ra.workspace
        mr = int(lay["max_rows"])
        expert_out = _mem(ra.expert_out, 2 * mr * h, torch.bfloat16).view(-1, h)
        entries = _mem(ws + lay["entries"], 32 * nr * ns, torch.int32).view(nr * ns, 8)
        first = _mem(ws + lay["batch_offsets"], 8 * (nr * ns + 1), torch.int64)
        slot_of_all = _mem(ws + lay["slot_of"], 8 * mr, torch.int64).view(-1, topk)
        resp_off = _mem(cfg.response_ring_offset, 8 * nr, torch.int64)
        slot_bytes = self._layout(cfg).response_slot_bytes
        for e in range(nr * ns):
            if int(entries[e, 0]) != 1:  # not kServe
                continue
            n, layer = int(entries[e, 2]), int(entries[e, 4])
            seq = int(entries[e].view(torch.int64)[3])
            c, s = divmod(e, ns)
            slot_of = slot_of_all[int(first[e]) : int(first[e]) + n]
            y = torch.zeros(n, h)
            for j in range(topk):
                got = expert_out.index_select(0, slot_of[:, j].clamp(min=0)).float()
                y += torch.where((slot_of[:, j] >= 0)[:, None], got, 0.0)
            self.answered.append((c, s, seq))
            # The kernel releases our request slot by compare-exchange from READY|seq: a
            # combine's sequence never matches a request's, so the request stays there until
            # the client's next one overwrites it (a later gather sees it as stale).
            base = self._base(peers, c)
            if base == self.drop_answers_to:
                continue
            dst = base + int(resp_off[c]) + _C_slot_offset(slot_bytes, s) + _C_PAYLOAD
            _mem(dst, 2 * y.numel(), torch.bfloat16).view_as(y).copy_(y)
            self.responses[(base, int(resp_off[c]), s)] = (seq, n, layer)

    def client_combine(self, peers, cfg, ca, stream):
        nr, codes = cfg.num_servers, self.SERVER_STATUS
        assert ca.num_tokens == 0 and ca.timeout_ns > 0
        lay, ws = self.client_workspace_layout(cfg), ca.workspace
        sent = _mem(ws + lay["sent_seq"], 8 * nr, torch.int64)
        count = _mem(ws + lay["count"], 4 * nr, torch.int32)
        status = _mem(ws + lay["status"], 4 * nr, torch.int32)
        resp_off = _mem(cfg.response_ring_offset, 8 * nr, torch.int64)
        deadline = time.monotonic() + (1.0 if self.drop_answers_to else 10.0)
        for s in range(nr):  # the wait kernel: until the answer is there or the deadline
            want = (int(sent[s]), int(count[s]), ca.layer_id)
            key = (peers.local_base, int(resp_off[s]), ca.slot)
            while sent[s] and self.responses.get(key) != want and time.monotonic() < deadline:
                time.sleep(1e-3)
            status[s] = codes["NOT_SENT"] if not sent[s] else codes["OK"]
            if sent[s] and self.responses.get(key) != want:
                status[s] = codes["TIMEOUT"]


from moecomm._C import PAYLOAD_OFFSET as _C_PAYLOAD  # noqa: E402
from moecomm._C import slot_offset as _C_slot_offset  # noqa: E402


@pytest.fixture
def glue(monkeypatch):
    monkeypatch.setattr(ll_device, "_cuda", _FAKE_CUDA)
    monkeypatch.setattr(ll_device, "_bytes_view", lambda ptr, n, owner, device: _mem(ptr, n))
    kernels = _Kernels()
    store = dist.HashStore()
    bufs = [
        Buffer(None, low_latency_mode=True, rank=r, num_ranks=R, store=store, timeout=10)
        for r in range(R)
    ]
    for b in bufs:
        b._mode, b._device = "cuda", ll_device.DevicePath(b, kernels=kernels)
    yield bufs, kernels
    for b in bufs:
        b.destroy()


def _all(fn):
    with ThreadPoolExecutor(R) as ex:
        return list(ex.map(fn, range(R)))


def _dispatch(buf, x, idx, use_fp8=True, hook=False, round_scale=False, ue8m0=False, cost=None):
    flags = (use_fp8, round_scale, ue8m0)
    return buf._device.dispatch(x, idx, M, E, None, cost, flags, hook, torch.device("cpu"))


def _check_receive(got, inputs, sources, use_fp8: bool, ue8m0: bool = False):
    """Checks every rank's receive against the sources; returns each rank's expert outputs."""
    ys = []
    for r, (recv_x, count, handle, event, _) in enumerate(got):
        assert isinstance(event, ll_device.CudaEvent)
        data, scales = recv_x if use_fp8 else (recv_x, None)
        y = torch.full((L, R * M, H), float("nan"), dtype=torch.bfloat16)
        for e in range(L):
            ge = r * L + e
            want = [(p, t) for p in range(R) for t in range(inputs[p][0].shape[0])]
            want = [(p, t) for p, t in want if ge in inputs[p][1][t].tolist()]
            n = len(want)
            assert int(count[e]) == n and handle[0][e, :n].tolist() == [t for _, t in want]
            assert bool((handle[0][e, n:] == -1).all())
            begin = 0
            for p in range(R):
                c = sum(1 for q, _ in want if q == p)
                assert int(handle[1][e, p]) == (begin << 32) | c
                begin += c
            if not n:
                continue
            wire = torch.stack([sources[p][0][t] for p, t in want])
            assert torch.equal(data[e, :n].view(torch.uint8), wire.view(torch.uint8))
            if use_fp8:
                assert scales.stride(1) == 1
                sc = torch.stack([sources[p][1][t] for p, t in want])
                if ue8m0:
                    assert scales.dtype == torch.int32 and scales.shape[2] == H // 512
                    sc = pack_ue8m0(sc)
                assert torch.equal(scales[e, :n], sc)
            y[e, :n] = _expert_output(torch.stack([sources[p][2][t] for p, t in want]), ge)
        ys.append(y)
    return ys


def _reference(inputs, sources, r, scale=1.0, logfmt=False, idx=None):
    """Σ_k w·y(t, k) in f32, k ascending (y optionally LogFMT-decoded), as bf16."""
    x, dispatched, w = inputs[r]
    idx = dispatched if idx is None else idx
    ref = torch.zeros(x.shape[0], H)
    for t in range(x.shape[0]):
        for k in range(K):
            if int(idx[t, k]) >= 0:
                y = _expert_output(sources[r][2][t], int(idx[t, k]))
                y = (y.float() * scale).to(torch.bfloat16)
                y = logfmt_roundtrip(y.view(1, H))[0] if logfmt else y.float()
                ref[t] = ref[t] + w[t, k] * y
    return ref.to(torch.bfloat16)


def _round(bufs, seed, sizes, use_fp8, hook, round_scale=False, ue8m0=False, **combine_kw):
    inputs = [_inputs(seed, p, n) for p, n in enumerate(sizes)]
    got = _all(lambda r: _dispatch(bufs[r], *inputs[r][:2], use_fp8, hook, round_scale, ue8m0))
    if hook:
        _all(lambda r: got[r][4]())
    sources = [_source(x, use_fp8, round_scale) for x, _, _ in inputs]
    ys = _check_receive(got, inputs, sources, use_fp8, ue8m0)

    def combine(r):
        _, idx, w = inputs[r]
        kw = dict(combine_kw, return_recv_hook=hook)
        return bufs[r].low_latency_combine(ys[r], idx, w, got[r][2], **kw)

    outs = _all(combine)
    if hook:
        _all(lambda r: outs[r][2]())
    for r, (out, _, _) in enumerate(outs):
        ref = _reference(inputs, sources, r, logfmt=combine_kw.get("use_logfmt", False))
        assert torch.equal(out, ref), f"rank {r}: combine differs"
    return inputs, sources, got, ys


@pytest.mark.parametrize("use_fp8", [False, True])
@pytest.mark.parametrize("hook", [False, True])
def test_device_glue_round_trips_with_stand_in_kernels(glue, use_fp8, hook):
    bufs, _ = glue
    for seed in range(3):  # both slots, then slot 0 again
        _round(bufs, seed, [M, 0, 4], use_fp8, hook)


@pytest.mark.parametrize("round_scale", [False, True])
def test_device_fp8_ships_deepeps_cast_on_awkward_blocks(glue, round_scale):
    """The bytes and scales the CUDA path hands the pack kernel are DeepEP's cast (_ll_cast):
    all-zero, tiny (< 1e-4) and huge blocks included, and round_scale's powers of two."""
    bufs, kernels = glue
    inputs = [_inputs(9, p, 4) for p in range(R)]
    for x, _, _ in inputs:
        x[0, :128] = 0.0  # all-zero: amax floored at 1e-4, not scale 1
        x[1, 128:] = (torch.randn(H - 128) * 1e-6).to(torch.bfloat16)  # tiny, scaled up
        x[2, :128] = (torch.randn(128) * 3e4).to(torch.bfloat16)  # huge
    _all(lambda r: _dispatch(bufs[r], *inputs[r][:2], True, False, round_scale))
    checked = 0
    for r in range(R):
        q, sc = deepep_cast(inputs[r][0], round_scale)
        for (_, _, slot), req in kernels.requests.items():
            if req["client"] == r + 1 and slot == 0:
                rows = req["scores"][:, 0].long()  # the source token of each row
                real = req["ids"][:, 0] < L  # sinks are zero rows
                assert torch.equal(req["acts"][real], q.view(torch.uint8)[rows[real]])
                assert torch.equal(req["scales"][real], sc[rows[real]])
                checked += int(real.sum())
        # DeepEP's all-zero block: amax floored at 1e-4 (moecomm's own cast would give 1).
        zero = torch.tensor(1e-4) * torch.tensor(1 / 448) if not round_scale else 2.0**-22
        assert float(sc[0, 0]) == float(zero)
    assert checked == sum(int((i[1] >= 0).sum()) for i in inputs)
    for fp8 in (True, False) if round_scale else ():  # ue8m0: packed exponents; bf16 ignores it
        _round(bufs, 9, [4, 4, 4], fp8, False, round_scale=True, ue8m0=True)


def test_device_handles_combine_any_number_of_times_and_uncombined_dispatches(glue):
    """Dispatch i + 2 without combining i; then i combined twice (after i + 2 reused its slot),
    the second with other expert outputs: each combine gets its own answers (own seqs)."""
    bufs, kernels = glue
    rounds = []
    for seed in (1, 2, 3):  # dispatch 0, 1, 2: none combined yet; 2 reuses slot 0
        inputs = [_inputs(seed, p, M - p) for p in range(R)]
        got = _all(lambda r, i=inputs: _dispatch(bufs[r], *i[r][:2], False, False))
        sources = [_source(x, False) for x, _, _ in inputs]
        rounds.append((inputs, sources, got, _check_receive(got, inputs, sources, False)))
    inputs, sources, got, ys = rounds[0]
    for scale in (1.0, 2.0, 1.0):  # three combines of dispatch 0, with different outputs
        outs = _all(
            lambda r, s=scale: bufs[r].low_latency_combine(
                (ys[r].float() * s).to(torch.bfloat16), *inputs[r][1:], got[r][2]
            )
        )
        for r, (out, _, _) in enumerate(outs):
            assert torch.equal(out, _reference(inputs, sources, r, scale)), f"rank {r}, x{scale}"
    # Combine c answered in response slot c % 2 with seq COMBINE_SEQ_BASE + c + 1.
    assert sorted(set(kernels.answered)) == sorted(
        {(p, c % 2, COMBINE_SEQ_BASE + c + 1) for p in range(R) for c in range(3)}
    )
    # Two combines in flight (hooks), then dispatch 2's handle, zero_copy and LogFMT.
    inputs, sources, got, ys = rounds[2]
    idx_less = [i[1].clone() for i in inputs]
    for t in idx_less:
        t[:, 0] = -1  # the combine's topk_idx drops k = 0: left out of the sum
    for r in range(R):
        bufs[r].get_next_low_latency_combine_buffer(got[r][2]).copy_(ys[r])
    modes = ({"zero_copy": True}, {"use_logfmt": True})

    def combine(r, kw):  # zero_copy: the expert outputs come from the buffer, not from x
        x = torch.zeros_like(ys[r]) if "zero_copy" in kw else ys[r]
        w, h = inputs[r][2], got[r][2]
        return bufs[r].low_latency_combine(x, idx_less[r], w, h, return_recv_hook=True, **kw)

    outs = [_all(lambda r, kw=kw: combine(r, kw)) for kw in modes]
    for kw, out in zip(modes, outs, strict=True):
        _all(lambda r, o=out: o[r][2]())
        for r in range(R):
            ref = _reference(inputs, sources, r, logfmt="use_logfmt" in kw, idx=idx_less[r])
            assert torch.equal(out[r][0], ref), f"rank {r}: {kw}"


def test_device_cost_stats_and_the_refusals(glue):
    bufs, _ = glue
    inputs = [_inputs(4, p, 3) for p in range(R)]
    cost = [torch.zeros(R, dtype=torch.int64) for _ in range(R)]
    for _ in range(2):
        before = [c.clone() for c in cost]
        got = _all(lambda r: _dispatch(bufs[r], *inputs[r][:2], True, False, cost=cost[r]))
        # Every request lands one gather pass late (stand-in): each rank's wait is > 0 ns.
        assert all(bool((c > b).all()) for c, b in zip(cost, before, strict=True))
    with pytest.raises(ValueError, match="int64"):
        _dispatch(bufs[0], *inputs[0][:2], cost=torch.zeros(R, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="inside a kernel"):
        bufs[0].low_latency_combine(
            torch.zeros(L, R * M, H, dtype=torch.bfloat16), *inputs[0][1:], got[0][2],
            combine_wait_recv_cost_stats=torch.zeros(R, dtype=torch.int64),
        )  # fmt: skip


def test_device_glue_a_lost_answer_is_reported_at_the_next_receive(glue):
    bufs, kernels = glue
    inputs = [[_inputs(seed, p, M - p) for p in range(R)] for seed in (1, 2)]
    got = [_all(lambda r, i=i: _dispatch(bufs[r], *inputs[i][r][:2], True, True)) for i in (0, 1)]
    for i in (1, 0):
        _all(lambda r, i=i: got[i][r][4]())
    y = torch.zeros(L, R * M, H, dtype=torch.bfloat16)
    # Rank 1's answers to rank 0 never land: rank 0's combine reports it at its next receive.
    kernels.drop_answers_to = bufs[0]._device.lanes[True].region.device_ptr
    for i in range(2):
        outs = _all(lambda r, i=i: bufs[r].low_latency_combine(y, *inputs[i][r][1:], got[i][r][2]))
        for out, _, _ in outs:
            assert out.shape[1] == H
    with pytest.raises(
        moecomm.DeadlineExceededError, match="combine of dispatch 0 got no valid answer"
    ):
        _dispatch(bufs[0], *inputs[0][0][:2], True, False)
