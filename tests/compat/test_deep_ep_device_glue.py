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
from moecomm.compat import _ll_device, _ll_device_path
from moecomm.compat.deep_ep import Buffer
from moecomm.ops.quant import quantize_reference
from moecomm.ops.reorg import reorganize
from moecomm.protocol import SlotLayout
from test_deep_ep_device_host import (
    FP8,
    E,
    H,
    K,
    L,
    M,
    R,
    _expert_output,
    _inputs,
    _source,
)


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

    def __init__(self):
        real = moecomm.cuda.cuda_module(need_device=False)
        for name in ("ClientConfig", "DispatchArgs", "CombineArgs", "ServerConfig",
                     "ServerGatherArgs", "ServerRespondArgs", "IpcPeers", "SERVER_STATUS",
                     "client_workspace_layout", "server_workspace_layout"):  # fmt: skip
            setattr(self, name, getattr(real, name))
        self.regions, self.requests, self.responses, self.gathered = {}, {}, {}, {}
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
            acts, scales = x[rows].clone(), None
            if cfg.encoding == int(FP8):
                acts, scales = quantize_reference(acts, FP8)
            local = torch.where(here, el[ids.clamp(0, a.num_experts - 1)], -1)[rows]
            key = (self._base(peers, s), int(req_off[s]), a.slot)
            self.requests[key] = {
                "client": cfg.client_id, "seq": int(seqs[s]), "layer": a.layer_id,
                "acts": acts, "scales": scales, "ids": local.to(torch.int32),
                "scores": torch.where(here, w, 0.0)[rows], "polls_left": 1,
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
                    req["polls_left"] -= 1
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
        self.gathered[ws] = (served, lay_r)

    def server_respond(self, peers, cfg, ra, stream):
        nr, h, ns = cfg.num_clients, cfg.hidden, cfg.num_slots
        lay = self.server_workspace_layout(cfg)
        served, lay_r = self.gathered.pop(ra.workspace)
        expert_out = _mem(ra.expert_out, 2 * int(lay["max_rows"]) * h, torch.bfloat16).view(-1, h)
        resp_off = _mem(cfg.response_ring_offset, 8 * nr, torch.int64)
        slot_bytes = self._layout(cfg).response_slot_bytes
        bo = lay_r.batch_offsets.tolist()
        for c, s, key, req in served:
            e = c * ns + s
            slot_of = lay_r.slot_of[bo[e] : bo[e + 1]]
            y = torch.zeros(slot_of.shape[0], h)
            for j in range(slot_of.shape[1]):
                got = expert_out.index_select(0, slot_of[:, j].clamp(min=0)).float()
                y += torch.where((slot_of[:, j] >= 0)[:, None], got, 0.0)
            base = self._base(peers, c)
            del self.requests[key]  # released
            if base == self.drop_answers_to:
                continue
            dst = base + int(resp_off[c]) + _C_slot_offset(slot_bytes, s) + _C_PAYLOAD
            _mem(dst, 2 * y.numel(), torch.bfloat16).view_as(y).copy_(y)
            self.responses[(base, int(resp_off[c]), s)] = (req["seq"], y.shape[0], req["layer"])

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
    monkeypatch.setattr(_ll_device, "_cuda", _FAKE_CUDA)
    monkeypatch.setattr(_ll_device, "_bytes_view", lambda ptr, n, owner, device: _mem(ptr, n))
    kernels = _Kernels()
    store = dist.HashStore()
    bufs = [
        Buffer(None, low_latency_mode=True, rank=r, num_ranks=R, store=store, timeout=10)
        for r in range(R)
    ]
    for b in bufs:
        b._mode, b._device = "cuda", _ll_device_path.DevicePath(b, kernels=kernels)
    yield bufs, kernels
    for b in bufs:
        b.destroy()


def _all(fn):
    with ThreadPoolExecutor(R) as ex:
        return list(ex.map(fn, range(R)))


def _glue_round(bufs, seed: int, sizes, use_fp8: bool, hook: bool):
    inputs = [_inputs(seed, p, n) for p, n in enumerate(sizes)]
    cpu = torch.device("cpu")

    def dispatch(r):
        x, idx, _ = inputs[r]
        return bufs[r]._device.dispatch(x, idx, M, E, None, use_fp8, hook, cpu)

    got = _all(dispatch)
    if hook:
        _all(lambda r: got[r][4]())
    sources = [_source(x, use_fp8) for x, _, _ in inputs]
    ys = []
    for r, (recv_x, count, handle, event, _) in enumerate(got):
        assert isinstance(event, _ll_device.CudaEvent)
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
                assert torch.equal(scales[e, :n], torch.stack([sources[p][1][t] for p, t in want]))
            y[e, :n] = _expert_output(torch.stack([sources[p][2][t] for p, t in want]), ge)
        ys.append(y)

    def combine(r):
        _, idx, w = inputs[r]
        return bufs[r].low_latency_combine(ys[r], idx, w, got[r][2], return_recv_hook=hook)

    outs = _all(combine)
    if hook:
        _all(lambda r: outs[r][2]())
    for r, (out, _, _) in enumerate(outs):
        x, idx, w = inputs[r]
        ref = torch.zeros(x.shape[0], H)
        for t in range(x.shape[0]):
            for k in range(K):
                if int(idx[t, k]) >= 0:
                    ref[t] = (
                        ref[t] + w[t, k] * _expert_output(sources[r][2][t], int(idx[t, k])).float()
                    )
        assert torch.equal(out, ref.to(torch.bfloat16)), f"rank {r}: combine differs"


@pytest.mark.parametrize("use_fp8", [False, True])
@pytest.mark.parametrize("hook", [False, True])
def test_device_glue_round_trips_with_stand_in_kernels(glue, use_fp8, hook):
    bufs, _ = glue
    for seed in range(3):  # both slots, then slot 0 again
        _glue_round(bufs, seed, [M, 0, 4], use_fp8, hook)


def test_device_glue_two_dispatches_in_flight_and_a_lost_answer(glue):
    bufs, kernels = glue
    cpu = torch.device("cpu")
    inputs = [[_inputs(seed, p, M - p) for p in range(R)] for seed in (1, 2)]
    got = [
        _all(
            lambda r, i=i: bufs[r]._device.dispatch(*inputs[i][r][:2], M, E, None, True, True, cpu)
        )
        for i in range(2)
    ]
    for i in (1, 0):
        _all(lambda r, i=i: got[i][r][4]())
    with pytest.raises(RuntimeError, match="not combined yet"):
        bufs[0]._device.dispatch(*inputs[0][0][:2], M, E, None, True, True, cpu)
    y = torch.zeros(L, R * M, H, dtype=torch.bfloat16)
    # Rank 1's answers to rank 0 never land: rank 0's combine reports it at its next receive.
    kernels.drop_answers_to = bufs[0]._device.lanes[True].region.device_ptr
    for i in range(2):
        outs = _all(lambda r, i=i: bufs[r].low_latency_combine(y, *inputs[i][r][1:], got[i][r][2]))
        for out, _, _ in outs:
            assert out.shape[1] == H
    with pytest.raises(moecomm.TimeoutError, match="combine of dispatch 0 got no valid answer"):
        bufs[0]._device.dispatch(*inputs[0][0][:2], M, E, None, True, False, cpu)
