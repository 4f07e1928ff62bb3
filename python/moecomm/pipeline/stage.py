"""One pipeline stage as a process: runs its current layers over each micro-batch, passes hidden
states downstream through the slot transport, and migrates KV caches when the layer map changes.

The stage is generic over a :class:`StageCompute` built in the child by a picklable factory
(the model-specific part lives with the model, e.g. ``moecomm_serving.engine.stages``; there a
stage's MoE layers may call expert servers through its own ``AttentionClient``).

Channels:
- control: a duplex pipe to the driver. The driver sends commands in order (``step``,
  ``remap``, ``free``, ``stop``); the stage answers with profiles, results (last stage) and
  errors. Every stage sees every command, so all agree on step order and layer maps.
- activations: a stage channel (``moecomm.wire.stage``, message kind STAGE) from stage b to
  b+1; micro-batch ``step`` is the package tagged ``step``, acknowledged by a header-only ack.
- KV: a stage channel from every stage to every other; a layer's cache is one package tagged
  with the layer, chunked to the slot size. It is sent the moment the source finishes that
  layer in the last step under the old map; the destination computes its other layers and
  blocks only when it reaches the migrated one.

All channels into a stage share one doorbell (:class:`~moecomm.wire.stage.StageInbox`; one per
transport when it speaks several): while it waits for anything, a stage takes and acknowledges
whatever arrived, so a sender blocked on a full channel always makes progress.

Transports: each pair of stages speaks the transport the runtime would pick for a client and a
server (``moecomm.wire.choose``): shm when the two share this host's shared memory (same boot id
and each other's probe word readable), nixl otherwise. Each stage offers what its ``transport``
allows, sees every other stage's offer (relayed by the driver), and picks per peer; the driver
checks that both ends of every pair picked the same. The control connection is a pipe to a
local driver, or a TCP connection (``moecomm.pipeline.agent``) to a driver on another host.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import safetensors.torch
import torch

from moecomm.errors import DeadlineExceededError, PeerLostError
from moecomm.wire.choose import ShmProbe, TransportSet, boot_id, choose
from moecomm.wire.protocol import SlotLayout
from moecomm.wire.stage import StageInbox, StageReceiver, StageSender, as_tensor

# A micro-batch or a migrated KV cache that has not arrived within this long means a peer is
# stuck or gone; generous because two cores are shared by all stages and other tenants.
STEP_TIMEOUT_S = 60.0
# Exit status of a stage whose driver vanished (no traceback: that is not the stage's fault).
DRIVER_GONE_EXIT = 2
# How often an idle stage checks that its driver still exists.
IDLE_POLL_S = 0.5
# Slots of each KV channel: a package larger than this many slots waits for the receiver's acks
# (which it gives whenever it waits for anything), so two keep the copy streaming.
KV_SLOTS = 2
ACT, KV = "act", "kv"
# How a stage's error report starts when it lost a peer (the driver then looks for the dead one).
PEER_LOST_PREFIX = "peer lost: "


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

    def sample(self, h: torch.Tensor):
        """Last stage: the next token of every sequence of the micro-batch (or, for a driver
        that samples itself, a picklable ``[B, vocab]`` array of their logits)."""

    def export_kv(self, layer: int) -> dict[str, torch.Tensor]:
        """Removes and returns every sequence's cache of `layer` as named CPU tensors (they
        travel as a safetensors package: data only, nothing executable)."""

    def import_kv(self, layer: int, package: dict[str, torch.Tensor]) -> None:
        """Adopts the caches of `layer` exported by another stage."""

    def free(self, seq_ids: Sequence[int]) -> None:
        """Forgets finished sequences."""

    def close(self) -> None:
        """Releases what the compute holds outside the process (expert-server connections)."""


@dataclass(frozen=True)
class StageSpec:
    """What a stage process is started with (all picklable)."""

    index: int
    num_stages: int
    ranges: tuple[range, ...]  # initial layer map of the whole pipeline
    preload: range  # layers whose weights this stage loads (any it may be given)
    layout: dict  # SlotLayout.to_dict() of every stage channel (stage_channel.stage_layout)
    num_slots: int
    factory: Callable[[int, range, range], StageCompute]  # (index, preload, owned) -> compute
    timeout_s: float = STEP_TIMEOUT_S
    # What this stage offers its peers (one of wire.choose.TRANSPORT_CHOICES) and the address
    # nixl carries its bytes over (None: any interface).
    transport: str = "shm"
    host: str | None = None

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1


class _Stage:
    def __init__(self, spec: StageSpec, conn):
        self.spec, self.conn = spec, conn
        self.ranges = spec.ranges
        self.own = spec.ranges[spec.index]
        self.pending: dict[int, tuple[range, ...]] = {}  # effective step -> layer map
        self.awaiting: dict[int, int] = {}  # layer owned now whose cache is on its way -> source
        self.layout = SlotLayout.from_dict(spec.layout)
        self.compute = None  # built last: its start-up (weights, expert servers) is the slow part
        self.inbox: StageInbox | None = None
        self.senders: dict[tuple[str, int], StageSender] = {}
        self.receivers: dict[tuple[str, int], StageReceiver] = {}
        self.transports = TransportSet(spec.transport, host=spec.host)
        shm = "shm" in self.transports.names
        self.probe = ShmProbe(self.transports.get("shm")) if shm else None
        self.choices: dict[int, str] = {}  # peer stage -> transport name

    def _open_channels(self, offers: list[dict]) -> None:
        """Picks the transport of every peer from its offer, then makes the channels."""
        spec = self.spec
        me, n = spec.index, spec.num_stages
        for j in range(n):
            if j != me:
                self.choices[j] = choose(self.transports, offers[j], f"pipeline stage {j}")
        used = sorted(set(self.choices.values())) or [self.transports.names[0]]
        self.inbox = StageInbox([self.transports.get(name) for name in used])
        # The sender's index is the connection's client id: both ends know it.
        for kind, dst, slots in self._links(me, n):
            t = self.transports.get(self.choices[dst])
            self.senders[(kind, dst)] = StageSender(t, self.layout, me, slots, f"{kind}->{dst}")
        for kind, src, slots in self._links_in(me, n):
            t = self.transports.get(self.choices[src])
            r = StageReceiver(t, self.layout, src, slots, f"{kind}<-{src}")
            self.receivers[(kind, src)] = r
            self.inbox.add((kind, src), r)
        self.compute = spec.factory(spec.index, spec.preload, self.own)

    def _links(self, me: int, n: int):
        """(kind, destination, slots) of every channel this stage sends on."""
        if me + 1 < n:
            yield ACT, me + 1, self.spec.num_slots
        for dst in range(n):
            if dst != me:
                yield KV, dst, KV_SLOTS

    def _links_in(self, me: int, n: int):
        if me > 0:
            yield ACT, me - 1, self.spec.num_slots
        for src in range(n):
            if src != me:
                yield KV, src, KV_SLOTS

    # ------------------------------------------------------------------ set-up
    def offer(self) -> dict:
        """What this stage offers its peers, in the shape of a server's GET /transports."""
        out = {"transports": list(self.transports.names), "boot_id": boot_id()}
        if self.probe is not None:
            out["shm_probe"] = self.probe.describe()
        return out

    def handshake(self) -> None:
        self.conn.send(("hello", self.offer(), os.getpid(), socket.gethostname()))
        _, offers = self._recv("offers")
        self._open_channels(offers)
        bells = {name: self.inbox.doorbell_handle_of(name) for name in set(self.choices.values())}
        self.conn.send(
            (
                "ready",
                bells,
                {key: r.handle for key, r in self.receivers.items()},
                {key: s.handle for key, s in self.senders.items()},
                dict(self.choices),
            )
        )
        # For each of our senders: (receiver handle, doorbell) at its destination; for each of
        # our receivers: the sender handle at its source.
        _, to_receivers, to_senders = self._recv("connect")
        for key, sender in self.senders.items():
            sender.connect(*to_receivers[key])
        for key, receiver in self.receivers.items():
            receiver.connect(to_senders[key])
        self.conn.send(("connected",))

    def _recv(self, kind: str):
        deadline = time.monotonic() + self.spec.timeout_s
        while not self.conn.poll(IDLE_POLL_S):
            if time.monotonic() > deadline:
                raise DeadlineExceededError(f"stage {self.spec.index}: no {kind!r} from the driver")
        msg = self.conn.recv()
        if msg[0] != kind:
            raise RuntimeError(f"stage {self.spec.index}: expected {kind!r}, got {msg[0]!r}")
        return msg

    # ------------------------------------------------------------------ main loop
    def run(self) -> None:
        driver_alive = _driver_alive_check()
        while True:
            if not self.conn.poll(IDLE_POLL_S):
                if not driver_alive():
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
            enc, data = self.inbox.take((ACT, self.spec.index - 1), step, self.spec.timeout_s)
            h = as_tensor(enc, data, self.layout.hidden)
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
                self._send_kv(i, outgoing[i])
        if self.spec.last:
            t0 = clock()
            out = self.compute.sample(h)
            t_sample = clock() - t0
            self.conn.send(("result", step, out, (num_new, lengths, layer_times, t_sample)))
        else:
            self.senders[(ACT, self.spec.index + 1)].send(step, h, self.spec.timeout_s)
            self.conn.send(("profile", step, (num_new, lengths, layer_times)))

    def _apply_map(self, ranges: tuple[range, ...]) -> None:
        new_own = ranges[self.spec.index]
        if not set(new_own) <= set(self.spec.preload):
            raise RuntimeError(
                f"stage {self.spec.index}: layer map gives it {new_own}, but only "
                f"{self.spec.preload} is preloaded"
            )
        old_owner = {i: s for s, r in enumerate(self.ranges) for i in r}
        for i in set(new_own) - set(self.own):
            self.awaiting[i] = old_owner[i]
        self.ranges, self.own = ranges, new_own
        self.compute.set_layers(new_own)

    # ------------------------------------------------------------------ KV migration
    def _send_kv(self, layer: int, dst: int) -> None:
        tensors = {k: v.contiguous() for k, v in self.compute.export_kv(layer).items()}
        blob = bytearray(safetensors.torch.save(tensors))
        package = torch.frombuffer(blob, dtype=torch.uint8)
        self.senders[(KV, dst)].send(layer, package, self.spec.timeout_s)

    def _wait_kv(self, layer: int) -> None:
        src = self.awaiting.pop(layer)
        _, data = self.inbox.take((KV, src), layer, self.spec.timeout_s)
        self.compute.import_kv(layer, safetensors.torch.load(data.numpy().tobytes()))

    def close(self) -> None:
        if self.compute is not None:
            self.compute.close()
        for s in self.senders.values():
            s.close()
        if self.inbox is not None:
            self.inbox.close()
        if self.probe is not None:
            self.probe.close()


# The spec of the stage running in this process (set by stage_main), for the compute's factory.
_RUNNING: StageSpec | None = None


def stage_host() -> str | None:
    """The address this stage process's host carries nixl over (its agent's address for a stage
    on another host, the driver's `host` for a local one); None outside a stage or when unset.
    A compute that opens its own connections (expert servers over nixl) binds them to it."""
    return None if _RUNNING is None else _RUNNING.host


def stage_main(spec: StageSpec, conn) -> None:
    """Child-process entry point. Any failure is reported to the driver, then re-raised (the
    process exits non-zero, which the driver also sees)."""
    global _RUNNING
    _RUNNING = spec
    torch.set_num_threads(1)  # stages share the host's cores; one thread each
    # Ctrl-C in a terminal reaches the whole process group: the driver decides when stages
    # stop (and they stop on their own when it dies).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stage = None
    try:
        stage = _Stage(spec, conn)
        stage.handshake()
        stage.run()
    except PeerLostError as e:
        with contextlib.suppress(OSError):
            conn.send(("error", spec.index, f"{PEER_LOST_PREFIX}{e}"))
        raise
    except (EOFError, BrokenPipeError, ConnectionResetError):
        # The driver's pipe broke (it was killed with its front end): nobody is left to tell
        # or to serve.
        sys.exit(DRIVER_GONE_EXIT)
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(("error", spec.index, traceback.format_exc()))
        raise
    finally:
        if stage is not None:
            stage.close()


def _driver_alive_check() -> Callable[[], bool]:
    """Whether the process that started this stage still lives: multiprocessing's sentinel of
    its parent (at EOF once the parent died, whether the stage was spawned or forked from a
    server, where the parent pid is the server's), else the parent pid."""
    parent = mp.parent_process()
    if parent is not None:
        return parent.is_alive
    ppid = os.getppid()
    return lambda: os.getppid() == ppid
