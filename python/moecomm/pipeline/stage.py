"""One pipeline stage as a process: runs its current layers over each micro-batch, passes hidden
states downstream through the slot transport, and migrates KV caches when the layer map changes.

The stage is generic over a :class:`StageCompute` built in the child by a picklable factory
(the model-specific part lives with the model, e.g. ``moecomm_serving.pipeline_stages``).

Channels:
- control: a duplex pipe to the driver. The driver sends commands in order (``step``,
  ``remap``, ``free``, ``stop``); the stage answers with profiles, results (last stage) and
  errors. Every stage sees every command, so all agree on step order and layer maps.
- activations: stage b is the *client* of stage b+1 (ClientChannel / ServerChannel over shm);
  micro-batch ``step`` travels in slot ``step % num_slots`` with ``layer_id = step``, and the
  downstream stage's response (an echo) is the acknowledgement that frees the slot.
- KV: one ``multiprocessing`` queue per stage (its inbox). A layer's cache is sent the moment the
  source finishes that layer in the last step under the old map; the destination computes its
  other layers and blocks only when it reaches the migrated one.
"""

from __future__ import annotations

import contextlib
import os
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from moecomm.errors import PeerLostError
from moecomm.protocol import SlotLayout
from moecomm.slots import ClientChannel, ServerChannel
from moecomm.transport import ShmTransport

# A micro-batch or a migrated KV cache that has not arrived within this long means a peer is
# stuck or gone; generous because two cores are shared by all stages and other tenants.
STEP_TIMEOUT_S = 60.0
# How often an idle stage checks that its driver still exists.
IDLE_POLL_S = 0.5
# Bounded waits inside a step, so the stage can notice a dead driver while waiting.
WAIT_SLICE_S = 0.5


class StageCompute(Protocol):
    """The model-specific work of a stage. Layer ids are global."""

    def set_layers(self, layers: range) -> None:
        """The layers this stage owns from now on (new sequences get caches for these)."""

    def begin(self, seq_ids: Sequence[int], past: Sequence[int], num_new: Sequence[int]) -> None:
        """Starts a micro-batch: sequence ids, cached lengths and new-token counts."""

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """First stage: token ids ``[T]`` -> hidden ``[T, H]``."""

    def layer(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Runs one owned layer over the micro-batch's packed hidden states."""

    def sample(self, h: torch.Tensor) -> list[int]:
        """Last stage: the next token of every sequence of the micro-batch."""

    def export_kv(self, layer: int) -> object:
        """Removes and returns (picklable) every sequence's cache of `layer`."""

    def import_kv(self, layer: int, package: object) -> None:
        """Adopts the caches of `layer` exported by another stage."""

    def free(self, seq_ids: Sequence[int]) -> None:
        """Forgets finished sequences."""


@dataclass(frozen=True)
class StageSpec:
    """What a stage process is started with (all picklable)."""

    index: int
    num_stages: int
    ranges: tuple[range, ...]  # initial layer map of the whole pipeline
    preload: range  # layers whose weights this stage loads (any it may be given)
    layout: dict  # SlotLayout.to_dict() of the activation slots
    num_slots: int
    factory: Callable[[int, range, range], StageCompute]  # (index, preload, owned) -> compute
    timeout_s: float = STEP_TIMEOUT_S

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1


class _Stage:
    def __init__(self, spec: StageSpec, conn, inboxes: list):
        self.spec, self.conn, self.inboxes = spec, conn, inboxes
        self.ranges = spec.ranges
        self.own = spec.ranges[spec.index]
        self.compute = spec.factory(spec.index, spec.preload, self.own)
        self.pending: dict[int, tuple[range, ...]] = {}  # effective step -> layer map
        self.stash: dict[int, torch.Tensor] = {}  # step -> hidden states that arrived early
        self.kv_stash: dict[int, object] = {}  # layer -> package that arrived early
        self.awaiting: set[int] = set()  # layers owned now whose cache has not arrived yet
        self.acks: dict[int, int] = {}  # slot -> seq of the request not yet acknowledged
        layout = SlotLayout.from_dict(spec.layout)
        self.zeros_ids = torch.zeros(layout.max_tokens, layout.topk, dtype=torch.int32)
        self.zeros_scores = torch.zeros(layout.max_tokens, layout.topk, dtype=torch.float32)
        t = ShmTransport()
        self.up = None if spec.first else ServerChannel(t, layout, spec.index - 1, spec.num_slots)
        self.down = None if spec.last else ClientChannel(t, layout, spec.index, spec.num_slots)

    # ------------------------------------------------------------------ set-up
    def handshake(self) -> None:
        self.conn.send(
            (
                "ready",
                self.up.handle if self.up else None,
                self.down.handle if self.down else None,
            )
        )
        _, downstream_server, upstream_client = self._recv("connect")
        if self.down is not None:
            self.down.connect(downstream_server)
        if self.up is not None:
            self.up.connect(upstream_client)
        self.conn.send(("connected",))

    def _recv(self, kind: str):
        deadline = time.monotonic() + self.spec.timeout_s
        while not self.conn.poll(IDLE_POLL_S):
            if time.monotonic() > deadline:
                raise TimeoutError(f"stage {self.spec.index}: no {kind!r} from the driver")
        msg = self.conn.recv()
        if msg[0] != kind:
            raise RuntimeError(f"stage {self.spec.index}: expected {kind!r}, got {msg[0]!r}")
        return msg

    # ------------------------------------------------------------------ main loop
    def run(self) -> None:
        parent = os.getppid()
        while True:
            if not self.conn.poll(IDLE_POLL_S):
                if os.getppid() != parent:
                    return  # the driver died: nobody to serve
                continue
            msg = self.conn.recv()
            kind = msg[0]
            if kind == "stop":
                return
            if kind == "step":
                self.step(*msg[1:])
            elif kind == "remap":
                self.pending[msg[1]] = tuple(msg[2])
            elif kind == "free":
                self.compute.free(msg[1])
            else:
                raise RuntimeError(f"stage {self.spec.index}: unknown command {kind!r}")

    def step(self, step: int, seq_ids, past, num_new, tokens) -> None:
        if step in self.pending:
            self._apply_map(self.pending.pop(step))
        following = self.pending.get(step + 1)
        outgoing = {}
        if following is not None:  # this is the last step under the current map
            new_owner = {i: s for s, r in enumerate(following) for i in r}
            outgoing = {i: new_owner[i] for i in self.own if new_owner[i] != self.spec.index}
        self.compute.begin(seq_ids, past, num_new)
        if self.spec.first:
            h = self.compute.embed(torch.as_tensor(tokens, dtype=torch.int64))
        else:
            h = self._receive(step)
        lengths = [p + n for p, n in zip(past, num_new, strict=True)]
        layer_times, clock = [], time.perf_counter
        for i in self.own:
            if i in self.awaiting:
                self._wait_kv(i)
            t0 = clock()
            h = self.compute.layer(i, h)
            layer_times.append(clock() - t0)
            if i in outgoing:
                # Sent now, not at the end of the step: the receiver may already be waiting.
                package = self.compute.export_kv(i)
                self.inboxes[outgoing[i]].put((i, step, package))
        if self.spec.last:
            t0 = clock()
            out = self.compute.sample(h)
            t_sample = clock() - t0
            self.conn.send(("result", step, out, (num_new, lengths, layer_times, t_sample)))
        else:
            self._send(step, h)
            self.conn.send(("profile", step, (num_new, lengths, layer_times)))

    def _apply_map(self, ranges: tuple[range, ...]) -> None:
        new_own = ranges[self.spec.index]
        if not set(new_own) <= set(self.spec.preload):
            raise RuntimeError(
                f"stage {self.spec.index}: layer map gives it {new_own}, but only "
                f"{self.spec.preload} is preloaded"
            )
        self.awaiting |= set(new_own) - set(self.own)
        self.ranges, self.own = ranges, new_own
        self.compute.set_layers(new_own)

    # ------------------------------------------------------------------ activations
    def _receive(self, step: int) -> torch.Tensor:
        deadline = time.monotonic() + self.spec.timeout_s
        while step not in self.stash:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"stage {self.spec.index}: step {step} did not arrive from stage "
                    f"{self.spec.index - 1} within {self.spec.timeout_s} s"
                )
            for req in self.up.wait(timeout=WAIT_SLICE_S):
                if not req.valid:
                    raise RuntimeError(f"stage {self.spec.index}: invalid activation header")
                # Copy out before acknowledging: the ack hands the slot back to the sender.
                self.stash[req.layer_id] = req.activations.clone()
                self.up.respond(req, req.activations)
        return self.stash.pop(step)

    def _send(self, step: int, h: torch.Tensor) -> None:
        slot = step % self.spec.num_slots
        if slot in self.acks:  # the slot's previous micro-batch must have been taken
            self.down.wait(slot, self.acks.pop(slot), timeout=self.spec.timeout_s)
            self.down.release(slot)  # the ack is not read: the slot is ours to reuse
        n = h.shape[0]
        self.acks[slot] = self.down.send(
            slot, h.contiguous(), self.zeros_ids[:n], self.zeros_scores[:n], layer_id=step
        )

    # ------------------------------------------------------------------ KV migration
    def _wait_kv(self, layer: int) -> None:
        deadline = time.monotonic() + self.spec.timeout_s
        inbox = self.inboxes[self.spec.index]
        while layer not in self.kv_stash:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"stage {self.spec.index}: the KV cache of layer {layer} did not arrive "
                    f"within {self.spec.timeout_s} s"
                )
            with contextlib.suppress(queue.Empty):
                got_layer, _, package = inbox.get(timeout=WAIT_SLICE_S)
                self.kv_stash[got_layer] = package
        self.compute.import_kv(layer, self.kv_stash.pop(layer))
        self.awaiting.discard(layer)

    def close(self) -> None:
        for ch in (self.up, self.down):
            if ch is not None:
                ch.close()


def stage_main(spec: StageSpec, conn, inboxes: list) -> None:
    """Child-process entry point. Any failure is reported to the driver, then re-raised (the
    process exits non-zero, which the driver also sees)."""
    torch.set_num_threads(1)  # stages share the host's cores; one thread each
    for q in inboxes:
        # A stage that stops with a package nobody reads must not block on flushing it.
        q.cancel_join_thread()
    stage = None
    try:
        stage = _Stage(spec, conn, inboxes)
        stage.handshake()
        stage.run()
    except PeerLostError as e:
        with contextlib.suppress(OSError):
            conn.send(("error", spec.index, f"peer lost: {e}"))
        raise
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(("error", spec.index, traceback.format_exc()))
        raise
    finally:
        if stage is not None:
            stage.close()
