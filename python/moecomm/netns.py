"""Several "hosts" on one machine: a private lab of network namespaces joined by a bridge.

For tests and benchmarks that must prove only the network carries data between two processes.
A `Lab` makes a "switch" namespace holding a Linux bridge, and one namespace per host with a veth
pair into the switch and an address on a private test subnet. `Lab.spawn` runs a program in a
host's network namespace *and* in fresh mount, IPC and PID namespaces with a private tmpfs on
/dev/shm, so shared memory, SysV IPC and signals cannot cross hosts either (the rest of the file
system, /tmp included, stays shared, so results can come back through files).

Nothing is created in the root network namespace: the veth pair is made inside the switch
namespace with its peer end placed straight into the host namespace. Needs root, `ip` (iproute2)
and `unshare` (util-linux); `available()` says whether they work here.

    with Lab() as lab:
        a, b = lab.add_host("a"), lab.add_host("b")
        server = lab.spawn(b, ["python", "server.py"])
        rc, out, err = lab.run(a, ["python", "client.py", b.addr], timeout=30)
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# Linux interface names are at most 15 characters (IFNAMSIZ - 1); namespace names have no such
# limit, but a short prefix keeps `ip netns list` readable and leaves room for host names.
MAX_PREFIX = 8
MAX_HOST_NAME = 16
BRIDGE = "br0"
HOST_IF = "eth0"
# Size of each host's private /dev/shm: tmpfs only takes pages as they are written, so this is a
# ceiling that protects the machine, not a reservation.
SHM_SIZE = "1g"
# Grace between SIGTERM and SIGKILL on close: long enough for a Python program with a handler to
# flush, short enough that a test's teardown is not noticeably slowed.
TERM_GRACE_S = 1.0
# Bound on any one `ip` call: they are instant unless the kernel is wedged.
IP_TIMEOUT_S = 10.0

# PID 1 of the new PID namespace: mounts the private /dev/shm, then runs argv as its child and
# exits with argv's status. argv is deliberately not exec'd: the kernel drops signals that the
# namespace's init has no handler for, so a PID-1 program would never see a SIGTERM; as a child in
# the same process group it gets SIGTERM from kill() like any process. The trailing `exit` stops
# the shell from exec'ing the last command in its place.
_SHM_WRAPPER = f'mount -t tmpfs -o size={SHM_SIZE} tmpfs /dev/shm || exit 125; "$@"; exit $?'


@dataclass(frozen=True)
class Host:
    name: str
    netns: str
    addr: str


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if r.returncode != 0:
        raise OSError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")


def _netns_exists(name: str) -> bool:
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return any(line.split()[0] == name for line in r.stdout.splitlines() if line.strip())


@functools.lru_cache(maxsize=1)
def available() -> tuple[bool, str]:
    """(True, "") when a Lab can be built here, else (False, why). Tried once per process: a
    throwaway namespace gets a bridge and a veth pair, then is deleted."""
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` not found on PATH"
    probe = f"mcprobe{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"cannot create a network namespace: {e}"
    try:
        _ip("link", "add", BRIDGE, "type", "bridge", netns=probe)
        _ip("link", "add", "v0", "type", "veth", "peer", "name", "v1", netns=probe)
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"no bridge/veth support: {e}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, ""


# Labs still open at interpreter exit are closed there (the safety net behind `with`).
_OPEN_LABS: weakref.WeakSet[Lab] = weakref.WeakSet()


@atexit.register
def _close_open_labs() -> None:
    for lab in list(_OPEN_LABS):
        lab.close()


class Lab:
    """A switch namespace with a bridge, and hosts added on demand (even while others run)."""

    def __init__(self, prefix: str | None = None, subnet: str | None = None):
        self.prefix = prefix or f"mc{secrets.token_hex(2)}"
        if len(self.prefix) > MAX_PREFIX or not self.prefix.isalnum():
            raise ValueError(f"prefix must be alphanumeric, at most {MAX_PREFIX} chars")
        # Labs never see each other (each has its own bridge); a random third octet only makes one
        # lab's addresses recognisable in logs next to another's.
        self.subnet = ipaddress.ip_network(subnet or f"10.231.{secrets.randbelow(256)}.0/24")
        self.switch = f"{self.prefix}sw"
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._addrs = self.subnet.hosts()
        self._closed = False
        _OPEN_LABS.add(self)
        try:
            self._add_netns(self.switch)
            _ip("link", "set", "lo", "up", netns=self.switch)
            # STP is off by default, so ports forward at once; nothing else to tune on a bridge
            # that only ever sees a handful of veths.
            _ip("link", "add", BRIDGE, "type", "bridge", netns=self.switch)
            _ip("link", "set", BRIDGE, "up", netns=self.switch)
        except BaseException:
            self.close()
            raise

    def _add_netns(self, name: str) -> None:
        if _netns_exists(name):
            raise FileExistsError(f"network namespace {name} already exists")
        _ip("netns", "add", name)
        self._namespaces.append(name)

    def add_host(self, name: str) -> Host:
        """A new namespace `<prefix><name>` with `eth0` on the bridge and the next address."""
        if self._closed:
            raise RuntimeError("lab is closed")
        if name in self.hosts or not name.isalnum() or len(name) > MAX_HOST_NAME or name == "sw":
            raise ValueError(f"bad or duplicate host name {name!r}")
        addr = str(next(self._addrs))
        netns = f"{self.prefix}{name}"
        self._add_netns(netns)
        # The switch-side end is named by a counter so it fits IFNAMSIZ whatever the host name
        # (and is not reused after a host that failed half-way).
        port = f"v{len(self._namespaces)}"
        _ip("link", "add", port, "type", "veth", "peer", "name", HOST_IF, "netns", netns,
            netns=self.switch)  # fmt: skip
        _ip("link", "set", port, "master", BRIDGE, "up", netns=self.switch)
        _ip("link", "set", "lo", "up", netns=netns)
        _ip("addr", "add", f"{addr}/{self.subnet.prefixlen}", "dev", HOST_IF, netns=netns)
        _ip("link", "set", HOST_IF, "up", netns=netns)
        host = Host(name, netns, addr)
        self.hosts[name] = host
        return host

    def spawn(
        self,
        host: Host,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        stdout=None,
        stderr=None,
        cwd: str | None = None,
    ) -> subprocess.Popen:
        """Start argv in host's network namespace and fresh mount/IPC/PID namespaces with a
        private /dev/shm. `ip netns exec` remounts /sys for the namespace; `--mount-proc` does the
        same for /proc, so ps and /proc/self describe the new PID namespace. `--kill-child`
        makes the namespace's init die with `unshare` itself, whatever signal killed it."""
        if self._closed:
            raise RuntimeError("lab is closed")
        cmd = [
            "ip", "netns", "exec", host.netns,
            "unshare", "--mount", "--ipc", "--pid", "--fork", "--mount-proc",
            "--kill-child=SIGKILL",
            "sh", "-c", _SHM_WRAPPER, "sh", *argv,
        ]  # fmt: skip
        proc = subprocess.Popen(
            cmd,
            env=None if env is None else dict(env),
            stdout=stdout,
            stderr=stderr,
            cwd=cwd,
            start_new_session=True,  # its own process group, so kill() reaches all of it
        )
        self._procs.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
        """Signal proc's process group (unshare, the namespace's init, and what it started)."""
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)

    def run(
        self, host: Host, argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None
    ) -> tuple[int, str, str]:
        """Spawn argv in host, wait up to timeout s, return (rc, stdout, stderr) as text. On
        timeout the process group is killed and subprocess.TimeoutExpired is raised."""
        proc = self.spawn(host, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill(proc)
            proc.communicate()
            raise
        return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")

    def close(self) -> None:
        """Kill every spawned process group, then delete every namespace this lab made (the
        veths go with them). Idempotent; errors are collected and raised only at the end, so
        one failure does not leave the rest behind."""
        if self._closed:
            return
        self._closed = True
        _OPEN_LABS.discard(self)
        live = [p for p in self._procs if p.poll() is None]
        for p in live:
            self.kill(p, signal.SIGTERM)
        deadline = time.monotonic() + TERM_GRACE_S
        for p in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
        for p in live:
            self.kill(p, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(IP_TIMEOUT_S)
        errors = []
        for name in reversed(self._namespaces):
            r = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True)
            if r.returncode != 0 and _netns_exists(name):
                errors.append(f"{name}: {r.stderr.strip()}")
        self._namespaces.clear()
        if errors:
            raise OSError("could not delete namespaces: " + "; ".join(errors))

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # Only a fallback for a lab dropped without close(); never raise from a finalizer (module
        # globals such as contextlib may already be gone at interpreter shutdown).
        try:  # noqa: SIM105
            self.close()
        except Exception:
            pass
