"""The `nixl` transport: the slot protocol between hosts, over NVIDIA's NIXL (UCX underneath).

`open_nixl_transport()` makes a Transport like `ShmTransport()`: regions a peer attaches to by
handle, one-sided puts, signal words, waits with deadlines. Its regions are host memory
registered with this process's NIXL agent; a region handle carries the agent's connection info
and the region's remote key, so attaching to a peer's region is all it takes to reach that peer
(no listener, no port of NIXL's own: the handles travel in moecomm's token-checked connect
handshake). How the transport orders payload before signal word is in
csrc/transport/nixl/nixl_transport.h; docs/transports.md says when to use it.

NIXL is optional: ``pip install 'moecomm[nixl]'``. Without it, asking for the transport raises
a MoecommError that names the extra.
"""

from __future__ import annotations

import base64
import collections
import fcntl
import logging
import os
import socket
import struct
import threading
import time
import uuid
import warnings

from moecomm import _C
from moecomm.errors import MoecommError

log = logging.getLogger("moecomm.nixl")

INSTALL_HINT = "pip install 'moecomm[nixl]'"
# The NIXL Python packages, by CUDA flavour; any one serves host memory.
_NIXL_MODULES = ("nixl_cu12._api", "nixl_cu13._api", "nixl._api")
# The NIXL progress thread's delay. NIXL 1.5's thread blocks in poll() on its UCX worker's event
# fd with this as the timeout (rounded up to whole ms), so bytes and notifications that arrive
# wake it at once and the delay only bounds how often an idle agent wakes for nothing: 100 µs
# (a 1 ms timeout) cost an idle agent ~2 % of a core, 10 ms ~0.4 % (bench/wire/cross_host.py, idle
# waiter); NIXL's own default, 0, turns the poll into a busy loop that takes a core per process
# (10-100x slower round trips on a 2-core host: bench/results/cross_host_ucx.json).
DEFAULT_PROGRESS_US = 10_000
PROGRESS_ENV = "MOECOMM_NIXL_PROGRESS_US"
# A transfer is spun on this long before its waiter sleeps XFER_POLL_S between checks: a small
# write across a fast network completes within it. The sleep leaves the CPU to the progress
# threads that move a large transfer's bytes (over UCX's TCP transport both ends' threads copy
# them): a waiter that only yielded kept a core busy for the whole transfer, which on a 2-core
# host made a 3.7 MB WRITE slower than NIXL's own with the same waiting policy.
SPIN_S = 50e-6
XFER_POLL_S = 20e-6
# NIXL errors of a well-formed handle whose agent cannot be reached (it died, or its address is
# not routable from here), as opposed to a handle NIXL cannot parse.
_UNREACHABLE_ERRORS = ("nixlBackendError", "nixlRemoteDisconnectError")
# A signal word rides on a NIXL notification (nixl_transport.h, "Ordering"): the message is this
# tag, then (address, value) pairs of little-endian u64s; anything else a peer sends is ignored.
NOTIF_MAGIC = b"MCW1"
_NOTIF_WORD = struct.Struct("<QQ")
# Prepared transfers kept for reposting, per engine: a slot's payload and its signal repeat the
# same descriptors every message, so the handle is made once. Bounded, since a stream of changing
# sizes would otherwise keep one per size; the oldest is released first.
MAX_PREPARED_XFERS = 256
# Durations of the latest transfers kept per engine (posted -> complete at the target), for the
# medians of bench/wire/cross_host.py's legs: a mean over every transfer is led by the first ones
# (endpoint wire-up) and the odd stall.
XFER_SAMPLES = 4096
# NIXL's memory segment types by our memory kinds.
_SEGMENT = {"host": "DRAM", "cuda": "VRAM"}
# SIOCGIFADDR: the IPv4 address of an interface (linux/sockios.h).
_SIOCGIFADDR = 0x8915
_IFNAMSIZ = 16

__all__ = [
    "INSTALL_HINT",
    "UCX_DEFAULTS",
    "NixlEngine",
    "NixlTransport",
    "TensorRegion",
    "apply_ucx_defaults",
    "available",
    "interface_of",
    "new_agent",
    "open_nixl_transport",
]


# NIXL logs every agent start at INFO on stdout; a server starts one per process. Its own
# variable still overrides this.
DEFAULT_NIXL_LOG_LEVEL = "WARN"


def _load():
    os.environ.setdefault("NIXL_LOG_LEVEL", DEFAULT_NIXL_LOG_LEVEL)
    errors = []
    for name in _NIXL_MODULES:
        try:
            module = __import__(name, fromlist=["nixl_agent"])
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        return module
    raise MoecommError(
        "the nixl transport needs NIXL, which is not installed: "
        + INSTALL_HINT
        + " (tried "
        + "; ".join(errors)
        + ")"
    )


def available() -> tuple[bool, str]:
    """Whether NIXL can be imported here, and why not."""
    try:
        _load()
    except MoecommError as exc:
        return False, str(exc)
    return True, ""


def interface_of(addr: str) -> str | None:
    """The network interface that holds IPv4 address `addr`, or None."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                raw = fcntl.ioctl(
                    s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[: _IFNAMSIZ - 1].encode())
                )
            except OSError:
                continue
        if socket.inet_ntoa(raw[20:24]) == addr:
            return name
    return None


# UCX settings moecomm gives its agent when the user has not set them (UCX reads its variables
# when the agent's UCX context is made; a variable the user set is never overridden). Measured
# on the lab's TCP link (veth -> bridge -> veth between namespaces) by
# `bench/wire/cross_host.py --ucx-sweep`: bench/results/cross_host_ucx.json; docs/transports.md.
# Of the settings tried (transports, rendezvous threshold, TCP segment and socket buffer sizes,
# Nagle, PUT zcopy, the progress thread), only these told apart under the load the sweep ran in:
# with Nagle on (UCX_TCP_NODELAY=n) a decode-size round trip took ~12x longer, with PUT zcopy
# off (UCX_TCP_PUT_ENABLE=n) 3-7x. They are UCX's own defaults today; pinned here so that a
# site's ucx.conf cannot turn them off unnoticed. The rest were within the run's noise.
UCX_DEFAULTS: dict[str, str] = {"UCX_TCP_NODELAY": "y", "UCX_TCP_PUT_ENABLE": "y"}
# Set to 0 to leave every UCX setting at UCX's own default.
UCX_DEFAULTS_ENV = "MOECOMM_NIXL_UCX_DEFAULTS"


def apply_ucx_defaults(env=None, defaults: dict[str, str] | None = None) -> dict[str, str]:
    """Sets each of `defaults` (UCX_DEFAULTS) in `env` (os.environ) that is not set there, unless
    MOECOMM_NIXL_UCX_DEFAULTS=0; returns what it set."""
    env = os.environ if env is None else env
    defaults = UCX_DEFAULTS if defaults is None else defaults
    if env.get(UCX_DEFAULTS_ENV, "1") == "0":
        return {}
    applied = {k: v for k, v in defaults.items() if k not in env}
    env.update(applied)
    return applied


_AGENT_LOCK = threading.Lock()


def _make_agent(api, name: str, config, progress_us: int):
    """nixl_agent with its progress thread's delay set: NIXL's Python wrapper hard-codes 0 (the
    thread yields in a loop and takes a whole core, idle or not) and has no setting for it, so
    the one call that builds the native config is wrapped while the agent is made."""
    native = api.nixlBind
    make = native.nixlAgent

    def with_delay(agent_name, agent_config):
        agent_config.pthrDelay = progress_us
        return make(agent_name, agent_config)

    with _AGENT_LOCK:
        native.nixlAgent = with_delay
        try:
            return api.nixl_agent(name, config)
        finally:
            native.nixlAgent = make


def new_agent(name: str | None = None, host: str | None = None, progress_us: int | None = None):
    """A NIXL agent with its UCX backend, set up as moecomm runs it: UCX's settings for this
    link (UCX_DEFAULTS, where unset), its bytes over the interface of `host`, the progress
    thread's delay (`progress_us`, else MOECOMM_NIXL_PROGRESS_US, else DEFAULT_PROGRESS_US),
    strict thread sync. Returns (agent, its name). bench/wire/cross_host.py times NIXL's own round
    trips on an agent made here, so both sides of that comparison run the same engine."""
    api = _load()
    if progress_us is None:
        progress_us = int(os.environ.get(PROGRESS_ENV, DEFAULT_PROGRESS_US))
    if progress_us < 0:
        raise ValueError(f"the progress thread's delay must be >= 0 µs, got {progress_us}")
    if host and host not in ("0.0.0.0", "") and "UCX_NET_DEVICES" not in os.environ:
        # Carry bytes over the interface the user serves on (UCX reads this at start).
        iface = interface_of(host)
        if iface is None:
            raise MoecommError(f"no network interface here holds the address {host}")
        os.environ["UCX_NET_DEVICES"] = iface
    apply_ucx_defaults()
    # Unique across hosts: pids collide between containers, host names may too.
    name = name or f"moecomm-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    sync = getattr(api, "nixl_thread_sync_t", None)
    kwargs = {"enable_prog_thread": True, "backends": ["UCX"]}
    if sync is not None:  # transfers come from the serving loop and the HTTP threads alike
        kwargs["sync_mode"] = sync.NIXL_THREAD_SYNC_STRICT
    agent = _make_agent(api, name, api.nixl_agent_config(**kwargs), progress_us)
    if "UCX" not in agent.backends:
        raise MoecommError("NIXL has no UCX backend here: the nixl transport needs it")
    return agent, name


class NixlEngine:
    """One NIXL agent with its UCX backend, as the C++ transport uses it (nixl_transport.h,
    `Engine`): memory registration, peers by metadata blob, blocking transfers with deadlines.
    Every method runs with the GIL held; the lock serializes the agent's bookkeeping."""

    def __init__(
        self, name: str | None = None, host: str | None = None, progress_us: int | None = None
    ):
        self.agent, self.name = new_agent(name, host, progress_us)
        self._lock = threading.Lock()
        self._regs: dict[int, object] = {}
        self._peers: dict[str, int] = {}
        # (op, agent, segments) -> a transfer handle that completed and may be posted again.
        self._prepared: dict[tuple, object] = {}
        self.transfers = 0
        self.transfers_by_op = {"WRITE": 0, "READ": 0}  # what a message costs, by kind
        self.prepared_hits = 0
        # Time from posting to completion of every transfer, summed (the per-leg breakdown of
        # bench/wire/cross_host.py: how much of a send is the network transfer itself).
        self.xfer_ns = 0
        self.xfer_samples_ns: collections.deque[int] = collections.deque(maxlen=XFER_SAMPLES)
        self.notifications_sent = 0
        self.notifications_received = 0

    # ------------------------------------------------------------------ the Engine interface
    def agent_name(self) -> str:
        return self.name

    def register_memory(self, addr: int, nbytes: int, memory: str = "host", device: int = 0) -> str:
        seg = _SEGMENT[memory]
        with self._lock:
            descs = self.agent.register_memory([(addr, nbytes, device, "")], seg)
            self._regs[addr] = descs
            blob = self.agent.get_partial_agent_metadata(descs, True)
        return base64.b64encode(blob).decode("ascii")

    def deregister_memory(self, addr: int, nbytes: int) -> None:
        with self._lock:
            descs = self._regs.pop(addr, None)
            if descs is not None:
                # A prepared transfer holds this memory's local metadata: none may outlive it.
                self._drop_prepared(lambda key: True)
                self.agent.deregister_memory(descs)

    def add_peer(self, blob: str) -> str:
        try:
            raw = base64.b64decode(blob.encode("ascii"), validate=True)
        except ValueError as exc:
            raise ValueError(f"a nixl region handle carries a malformed blob: {exc}") from None
        with self._lock:
            try:
                name = self.agent.add_remote_agent(raw)
            except Exception as exc:  # NIXL's own error types, told apart by name
                if type(exc).__name__ in _UNREACHABLE_ERRORS:
                    raise ConnectionError(
                        f"the peer of a nixl handle is unreachable: {exc}"
                    ) from None
                raise ValueError(
                    f"a nixl region handle carries no loadable metadata: {exc}"
                ) from None
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._peers[name] = self._peers.get(name, 0) + 1
        return name

    def release_peer(self, agent: str) -> None:
        with self._lock:
            n = self._peers.get(agent, 0) - 1
            if n > 0:
                self._peers[agent] = n
                return
            self._peers.pop(agent, None)
            self._drop_prepared(lambda key: key[1] == agent)
            try:
                self.agent.remove_remote_agent(agent)
            except Exception as exc:  # gone already: nothing to disconnect
                log.debug("nixl: removing %s: %s", agent, exc)

    def write(self, agent: str, segs: list, timeout_ns: int) -> int:
        return self._xfer("WRITE", agent, segs, timeout_ns)

    def read(self, agent: str, segs: list, timeout_ns: int) -> int:
        return self._xfer("READ", agent, segs, timeout_ns)

    def write_notify(self, agent: str, segs: list, words: list, timeout_ns: int) -> int:
        """Writes `segs` and then sets the peer's signal `words` ((address, value) pairs) through
        one NIXL notification, which NIXL's UCX backend sends only once the WRITE is complete at
        the target (nixl_transport.h, "Ordering"). Without segments the notification goes alone
        and nothing is waited for."""
        msg = NOTIF_MAGIC + b"".join(_NOTIF_WORD.pack(a, v) for a, v in words)
        if not segs:
            try:
                self.agent.send_notif(agent, msg)
                self.notifications_sent += 1
            except Exception as exc:  # not connected, or its agent is gone
                log.debug("nixl: notification to %s refused: %s", agent, exc)
                return _C.NIXL_XFER_PEER_LOST
            return _C.NIXL_XFER_DONE
        return self._xfer("WRITE", agent, segs, timeout_ns, msg)

    def drain_notifs(self) -> list:
        """The signal words peers sent since the last call, in the order each peer sent them, as
        (address, value) pairs for the transport to store into its own memory. Under the lock,
        so two draining threads never apply one peer's words out of order."""
        out = []
        with self._lock:
            try:
                notifs = self.agent.get_new_notifs()
            except Exception as exc:  # the agent is shutting down: nothing more arrives
                log.debug("nixl: reading notifications: %s", exc)
                return out
            for agent, msgs in notifs.items():
                for msg in msgs:
                    body = bytes(msg)
                    n = len(body) - len(NOTIF_MAGIC)
                    if not body.startswith(NOTIF_MAGIC) or n % _NOTIF_WORD.size:
                        log.debug("nixl: ignoring a notification from %s: %r", agent, body[:16])
                        continue
                    out.extend(_NOTIF_WORD.iter_unpack(body[len(NOTIF_MAGIC) :]))
                    self.notifications_received += 1
        return out

    # ------------------------------------------------------------------ transfers
    def _drop_prepared(self, which) -> None:
        """Releases the prepared transfers whose key `which` selects (the lock is held)."""
        for key in [k for k in self._prepared if which(k)]:
            try:
                self.agent.release_xfer_handle(self._prepared.pop(key))
            except Exception as exc:
                log.debug("nixl: releasing a prepared transfer: %s", exc)

    def _handle(self, op: str, agent: str, lk: str, rk: str, g: list):
        """A transfer of segments `g` (one pair of memory kinds) to `agent`: the prepared one when
        the same segments went before, else a new one (the lock is held)."""
        key = (op, agent, lk, rk, tuple(g))
        h = self._prepared.pop(key, None)
        if h is not None:
            self.prepared_hits += 1
            return key, h
        a = self.agent
        local = a.get_xfer_descs([(lo, n, ld) for lo, _, n, ld, _ in g], _SEGMENT[lk])
        remote = a.get_xfer_descs([(r, n, rd) for _, r, n, _, rd in g], _SEGMENT[rk])
        return key, a.initialize_xfer(op, local, remote, agent)

    def _keep(self, key, h) -> None:
        """Keeps a completed transfer for reposting (the lock is held)."""
        self._prepared[key] = h
        while len(self._prepared) > MAX_PREPARED_XFERS:
            oldest = next(iter(self._prepared))
            self._drop_prepared(lambda k, oldest=oldest: k == oldest)

    def _xfer(self, op: str, agent: str, segs: list, timeout_ns: int, notif: bytes = b"") -> int:
        """One NIXL transfer per pair of memory kinds (a descriptor list has one kind), all
        posted before any is waited for. `notif` goes with the last one; with more than one
        transfer it is sent on its own once all are complete, so it still follows every byte."""
        a = self.agent
        deadline = time.monotonic() + timeout_ns / 1e9
        groups: dict[tuple, list] = {}
        for lo, r, n, lk, ld, rk, rd in segs:
            groups.setdefault((lk, rk), []).append((lo, r, n, ld, rd))
        attach = notif if len(groups) == 1 else b""
        posted = []  # [key, handle, state]: each handle is this call's alone until kept
        try:
            try:
                with self._lock:
                    for (lk, rk), g in groups.items():
                        key, h = self._handle(op, agent, lk, rk, g)
                        posted.append([key, h, None])
            except Exception as exc:  # disconnected, or its metadata is gone with it
                log.debug("nixl: %s to %s refused: %s", op, agent, exc)
                return _C.NIXL_XFER_PEER_LOST
            posted_at = time.monotonic_ns()
            for p in posted:
                p[2] = a.transfer(p[1], attach)
            spin_until = time.monotonic() + SPIN_S
            while any(p[2] == "PROC" for p in posted):
                now = time.monotonic()
                if now >= deadline:
                    # In flight for good: a posted handle can be neither reposted nor released.
                    posted = [p for p in posted if p[2] != "PROC"]
                    return _C.NIXL_XFER_TIMEOUT
                if now >= spin_until:
                    time.sleep(XFER_POLL_S)
                for p in posted:
                    if p[2] == "PROC":
                        # NIXL sends an attached notification from here, once it finds the
                        # transfer complete: the wait is what lets it go.
                        p[2] = a.check_xfer_state(p[1])
            self.transfers += len(posted)
            self.transfers_by_op[op] += len(posted)
            took = time.monotonic_ns() - posted_at
            self.xfer_ns += took
            self.xfer_samples_ns.append(took)
            if not all(p[2] == "DONE" for p in posted):
                return _C.NIXL_XFER_PEER_LOST
            if notif and not attach:
                a.send_notif(agent, notif)
            if notif:
                self.notifications_sent += 1
            with self._lock:
                for p in posted:
                    self._keep(p[0], p[1])
            posted = []
            return _C.NIXL_XFER_DONE
        except Exception as exc:
            log.debug("nixl: %s to %s failed: %s", op, agent, exc)
            return _C.NIXL_XFER_PEER_LOST
        finally:
            for p in posted:  # failed or timed out: never posted again
                try:
                    a.release_xfer_handle(p[1])
                except Exception as exc:
                    log.debug("nixl: releasing a transfer to %s: %s", agent, exc)


def open_nixl_transport(
    host: str | None = None,
    name: str | None = None,
    spin_ns: int | None = None,
    poll_ns: int | None = None,
    xfer_timeout_s: float | None = None,
    progress_us: int | None = None,
    notify: bool = True,
    max_poll_ns: int | None = None,
    borrow: bool = True,
) -> _C.NixlTransport:
    """A nixl transport with its own NIXL agent. `host`: the address this process serves on;
    UCX carries bytes over that interface (unless UCX_NET_DEVICES says otherwise). `notify`:
    a signal word rides on its payload's NIXL notification, one transfer per message (False:
    each word is its own WRITE, waited for; kept to measure the difference). `max_poll_ns`: the
    longest sleep of a waiter that has been idle a while (the bound its back-off adds to a wake;
    nixl_transport.h, kBackoffAfterNs). `borrow`: a large put from this transport's own
    registered memory (its regions, a TensorRegion) is sent in place, with no staging copy; its
    bytes are read at the next signal (nixl_transport.h, "Zero copy"). False: every put is
    copied at once (kept to measure the difference)."""
    engine = NixlEngine(name=name, host=host, progress_us=progress_us)
    kwargs = {}
    if spin_ns is not None:
        kwargs["spin_ns"] = int(spin_ns)
    if poll_ns is not None:
        kwargs["poll_ns"] = int(poll_ns)
    if xfer_timeout_s is not None:
        kwargs["xfer_timeout_ns"] = int(xfer_timeout_s * 1e9)
    if max_poll_ns is not None:
        kwargs["max_poll_ns"] = int(max_poll_ns)
    t = _C.NixlTransport(engine, notify=bool(notify), borrow=bool(borrow), **kwargs)
    t.engine = engine  # for callers that want the agent (counters, UCX queries)
    return t


def NixlTransport(*args, **kwargs) -> _C.NixlTransport:
    """Deprecated: a function named like a class; call :func:`open_nixl_transport`."""
    warnings.warn(
        "moecomm NixlTransport() is now moecomm.wire.nixl.open_nixl_transport()",
        DeprecationWarning,
        stacklevel=2,
    )
    return open_nixl_transport(*args, **kwargs)


class TensorRegion:
    """`tensor`'s memory (CPU or CUDA: NIXL registers DRAM and VRAM alike) as a region of a nixl
    transport: peers attach to `handle`, and `transport.put_region(dst, offset, self.region, 0,
    nbytes)` sends from it without a copy; so does any large put from inside it (a host tensor
    of it passed to ClientChannel.send, say: nixl_transport.h, "Zero copy"). Holds the tensor,
    which must stay in place while peers may use the region; `close()` deregisters it."""

    def __init__(self, transport, tensor):
        if not tensor.is_contiguous():
            raise ValueError("a registered tensor must be contiguous")
        self.tensor = tensor
        memory = "cuda" if tensor.is_cuda else "host"
        device = (tensor.device.index or 0) if tensor.is_cuda else 0
        self.nbytes = tensor.numel() * tensor.element_size()
        self.region = transport.register_external(tensor.data_ptr(), self.nbytes, memory, device)

    @property
    def handle(self) -> str:
        return self.region.handle

    def close(self) -> None:
        self.region = None  # deregistered once the transport's last reference goes
