"""Which transport each peer pair speaks, and making one (docs/design.md, "Membership and
control plane"; docs/transports.md).

A process offers one or more transports (`TransportSet`): "shm", "nixl", or "auto" for both.
A client asks a server what it offers (GET /transports) and picks per server: shm only when it
can prove the two share a host's shared memory — the same boot id AND the server's probe word
readable through this process's /dev/shm (two containers on one kernel share the boot id but not
/dev/shm: probe, don't assume) — otherwise nixl. A forced choice that cannot work is a clear
error before any slot is allocated.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time

from moecomm import _C
from moecomm.errors import MoecommError
from moecomm.wire.shm import ShmTransport, shm_spin_ns
from moecomm.wire.transport import SignalOp, Transport, WaitStatus

log = logging.getLogger("moecomm.transports")

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
# With clients on several transports there is no single doorbell to sleep on: a server polls
# them all this often (a remote write cannot wake a sleeper anyway).
MULTI_DOORBELL_POLL_S = 20e-6
# The probe is one signal line of shm holding a random word (never 0: a fresh region reads 0).
PROBE_BYTES = 64
PROBE_OFFSET = 0

# What `transport=` accepts across the runtime and the CLI: one backend, or "auto" (shm with
# peers that share this host's /dev/shm, nixl with everyone else).
TRANSPORT_CHOICES = ("shm", "nixl", "auto")

__all__ = [
    "TRANSPORT_CHOICES",
    "Doorbells",
    "ShmProbe",
    "TransportSet",
    "boot_id",
    "choose",
    "make_transport",
    "shm_reachable",
]


def make_transport(
    name: str, host: str | None = None, xfer_timeout_s: float | None = None
) -> Transport:
    """A new transport of backend `name` ("shm" or "nixl"). `host`: the address this process
    serves on (nixl carries bytes over that interface); `xfer_timeout_s`: how long a nixl write
    may wait for a peer that does not take it (stopped, unreachable)."""
    if name == "shm":
        return ShmTransport(spin_ns=shm_spin_ns())
    if name == "nixl":
        # Imported here: NIXL is optional (pip install 'moecomm[nixl]').
        from moecomm.wire.nixl import open_nixl_transport

        return open_nixl_transport(host=host, xfer_timeout_s=xfer_timeout_s)
    raise ValueError(f"unknown transport {name!r}: one of shm, nixl")


def boot_id() -> str:
    try:
        with open(BOOT_ID_PATH) as f:
            return f.read().strip()
    except OSError:
        return ""


class TransportSet:
    """The transports one process offers, by name, created on first use. `spec`: a Transport
    (that one only), or one of TRANSPORT_CHOICES. With "auto" and NIXL not installed, the set
    offers shm alone (logged once). `xfer_timeout_s` bounds a nixl write to a peer that does not
    take it: a write waits for the peer's side of the transfer (a stopped peer never completes
    it), unlike a store into shared memory."""

    def __init__(
        self,
        spec: str | Transport | None = "shm",
        host: str | None = None,
        xfer_timeout_s: float | None = None,
    ):
        self.host = host
        self.xfer_timeout_s = xfer_timeout_s
        self._lock = threading.Lock()
        self._made: dict[str, Transport] = {}
        if spec is None:
            spec = "shm"
        if isinstance(spec, str):
            if spec not in TRANSPORT_CHOICES:
                raise ValueError(
                    f"unknown transport {spec!r}: one of {', '.join(TRANSPORT_CHOICES)}"
                )
            self.spec = spec
            if spec == "auto":
                from moecomm.wire.nixl import available

                ok, why = available()
                self.names = ["shm", "nixl"] if ok else ["shm"]
                if not ok:
                    log.info("transport auto: shm only (%s)", why)
            else:
                self.names = [spec]
            if spec == "nixl":
                self.get("nixl")  # fail now, with the extra's name, not at the first peer
        else:
            self.spec = spec.name
            self.names = [spec.name]
            self._made[spec.name] = spec

    def get(self, name: str) -> Transport:
        if name not in self.names:
            raise MoecommError(
                f"transport {name!r} is not offered here (this process offers "
                f"{', '.join(self.names)})"
            )
        with self._lock:
            t = self._made.get(name)
            if t is None:
                t = self._made[name] = make_transport(name, self.host, self.xfer_timeout_s)
            return t

    @property
    def primary(self) -> Transport:
        return self.get(self.names[0])

    def made(self) -> dict[str, Transport]:
        with self._lock:
            return dict(self._made)


class Doorbells:
    """A server's doorbells, one per transport it offers: a client rings the one in the memory
    its transport writes. With one transport the server sleeps on it (a futex for shm); with
    several it polls them all."""

    def __init__(self, transports: TransportSet):
        # (transport, region) by name, resolved once: the loop reads them every pass.
        self.bells = {
            n: (t, t.create_region(_C.DOORBELL_BYTES))
            for n, t in ((n, transports.get(n)) for n in transports.names)
        }

    def handle(self, name: str) -> str:
        return self.bells[name][1].handle

    def values(self) -> dict[str, int]:
        return {n: t.load(b, 0) for n, (t, b) in self.bells.items()}

    def wait(self, seen: dict[str, int], timeout: float) -> bool:
        """Sleeps until a doorbell moves past `seen` or `timeout` passes; False on timeout."""
        if len(self.bells) == 1:
            ((name, (t, bell)),) = self.bells.items()
            status, _ = _C.wait_doorbell(t, bell, seen[name], int(timeout * 1e9))
            return status != WaitStatus.TIMEOUT
        deadline = time.monotonic() + timeout
        while True:
            if self.values() != seen:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(MULTI_DOORBELL_POLL_S)

    def ring(self) -> None:
        for t, bell in self.bells.values():
            _C.ring_doorbell(t, bell)

    def close(self) -> None:
        for _, bell in self.bells.values():
            bell.close()


class ShmProbe:
    """A server's proof of where its shared memory lives: a shm word with a random value. A
    client that reads the same value through its own /dev/shm shares it."""

    def __init__(self, shm: Transport):
        self.region = shm.create_region(PROBE_BYTES)
        self.nonce = secrets.randbits(63) | 1
        shm.signal(self.region, PROBE_OFFSET, self.nonce, SignalOp.SET)

    def describe(self) -> dict:
        return {"handle": self.region.handle, "nonce": str(self.nonce)}

    def close(self) -> None:
        self.region.close()


def shm_reachable(offer: dict) -> bool:
    """Whether a server that answered `offer` (its GET /transports) shares our shared memory."""
    probe = offer.get("shm_probe")
    if not probe or offer.get("boot_id") != boot_id() or not boot_id():
        return False
    try:
        shm = ShmTransport(reap_on_start=False)
        region = shm.attach(str(probe["handle"]))
        try:
            return shm.load(region, PROBE_OFFSET) == int(probe["nonce"])
        finally:
            region.close()
    except Exception as exc:  # no such segment here: another /dev/shm
        log.debug("shm probe failed: %s", exc)
        return False


def choose(mine: TransportSet, offer: dict, url: str) -> str:
    """The transport to speak with the server at `url` that answered `offer`."""
    theirs = offer.get("transports", ["shm"]) if isinstance(offer, dict) else None
    if not isinstance(theirs, list) or not all(isinstance(n, str) for n in theirs):
        raise MoecommError(f"{url} answered GET /transports with something else: {offer!r:.200}")
    common = [n for n in mine.names if n in theirs]
    if not common and theirs == ["cuda_ipc"]:
        raise MoecommError(
            f"{url} is a GPU expert server (--device cuda, cuda_ipc only): its slots live in GPU "
            "memory; connect with a DeviceClient (`moecomm frontend --device cuda`)"
        )
    if not common:
        raise MoecommError(
            f"{url} offers transport {', '.join(theirs)}; this client speaks "
            f"{', '.join(mine.names)} (start one of them with --transport auto or a common one)"
        )
    if "shm" in common:
        if shm_reachable(offer):
            return "shm"
        if common == ["shm"]:
            raise MoecommError(
                f"{url} is not on this host's shared memory (different boot id or /dev/shm), "
                "so shm cannot reach it: use --transport nixl (or auto) on both sides"
            )
    return "nixl"
