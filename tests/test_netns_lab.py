"""The namespace lab (moecomm.netns): hosts reach each other only over the lab's bridge, each
spawned program has its own /dev/shm and PID namespace, and close() leaves nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest
from moecomm.netns import Lab, available

_OK, _WHY = available()
pytestmark = [pytest.mark.skipif(not _OK, reason=f"netns lab unavailable: {_WHY}")]

PY = sys.executable
PORT = 7311
# A one-shot echo server: binds the wildcard address so the test proves the route, not the bind.
ECHO_SERVER = f"""
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", {PORT}))
s.listen()
c, _ = s.accept()
data = b""
while len(data) < 65536:
    data += c.recv(65536 - len(data))
c.sendall(data)
"""
# Retries the connect: the server may still be starting in the other namespace.
ECHO_CLIENT = f"""
import os, socket, sys, time
for _ in range(100):
    try:
        c = socket.create_connection((sys.argv[1], {PORT}), timeout=1)
        break
    except OSError:
        time.sleep(0.05)
payload = os.urandom(65536)
c.sendall(payload)
got = b""
while len(got) < len(payload):
    got += c.recv(65536)
print("echo-ok" if got == payload else "echo-differs")
"""


def _root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip() for line in out.splitlines()}


def _netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _echo(lab: Lab, client, server) -> str:
    srv = lab.spawn(server, [PY, "-c", ECHO_SERVER], stderr=subprocess.PIPE)
    rc, out, err = lab.run(client, [PY, "-c", ECHO_CLIENT, server.addr], timeout=30)
    assert rc == 0, err
    assert srv.wait(10) == 0, srv.stderr.read().decode()
    return out.strip()


@pytest.mark.timeout(60)
def test_tcp_echo_across_hosts_and_a_host_added_later():
    links_before = _root_links()
    with Lab() as lab:
        a, b = lab.add_host("a"), lab.add_host("b")
        assert a.addr != b.addr
        assert _echo(lab, a, b) == "echo-ok"
        # A server joining while the lab runs is reachable from the hosts already there.
        c = lab.add_host("c")
        assert _echo(lab, a, c) == "echo-ok"
        assert _echo(lab, c, b) == "echo-ok"
        # Nothing was made in the root network namespace.
        assert _root_links() == links_before


@pytest.mark.timeout(60)
def test_dev_shm_is_private_to_each_spawn():
    name = f"moecomm-lab-{uuid.uuid4().hex}"
    with Lab() as lab:
        a, b = lab.add_host("a"), lab.add_host("b")
        script = f"ls -A /dev/shm; echo x > /dev/shm/{name} && ls -A /dev/shm"
        rc, out, err = lab.run(a, ["sh", "-c", script], timeout=20)
        assert rc == 0, err
        assert out.split() == [name]  # empty before the write: a fresh tmpfs
        rc, out, err = lab.run(b, ["sh", "-c", "ls -A /dev/shm"], timeout=20)
        assert rc == 0, err
        assert out.split() == []
        assert not os.path.exists(f"/dev/shm/{name}")
        # Not even a second program in the same host shares it: each spawn gets its own.
        rc, out, _ = lab.run(a, ["sh", "-c", "ls -A /dev/shm"], timeout=20)
        assert out.split() == []


@pytest.mark.timeout(60)
def test_each_spawn_has_its_own_pid_namespace():
    probe = (
        "import json, os; pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit()); "
        "print(json.dumps([os.getpid(), pids]))"
    )
    with Lab() as lab:
        a = lab.add_host("a")
        rc, out, err = lab.run(a, [PY, "-c", probe], timeout=20)
        assert rc == 0, err
        pid, visible = json.loads(out)
        # /proc was remounted for the new namespace: its init is PID 1, and only the lab's
        # wrapper and the probe itself are in it (none of the machine's processes).
        assert visible[0] == 1 and pid in visible, out
        assert len(visible) <= 3, out


@pytest.mark.timeout(60)
def test_close_leaves_nothing_even_when_the_body_raises():
    marker = f"moecomm-lab-{uuid.uuid4().hex}"
    links_before = _root_links()
    names = set()
    procs = []
    with pytest.raises(RuntimeError, match="boom"), Lab() as lab:
        for h in ("a", "b"):
            host = lab.add_host(h)
            names.add(host.netns)
            # Would outlive the test by far; argv carries the marker so a survivor is visible.
            procs.append(lab.spawn(host, [PY, "-c", "import time; time.sleep(600)", marker]))
        names.add(lab.switch)
        assert names <= _netns_names()
        raise RuntimeError("boom")
    assert not names & _netns_names()
    assert all(p.poll() is not None for p in procs)
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert marker not in ps
    assert _root_links() == links_before
    lab.close()  # idempotent
    with pytest.raises(RuntimeError):
        lab.add_host("late")
