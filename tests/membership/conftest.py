"""Fixtures: one monitor process and one etcd process per session (restart tests restart them in
place), and `backend`, which runs an interface test against both. Tests keep apart by unique
member ids (monitor) or a unique key prefix (etcd)."""

from __future__ import annotations

import pytest
from membership_procs import MONITOR_TOKEN, EtcdProcess, MonitorProcess, etcd_binary, open_backend


@pytest.fixture(scope="session")
def monitor_process():
    mon = MonitorProcess(token=MONITOR_TOKEN)
    mon.start()
    yield mon
    mon.stop()


@pytest.fixture(scope="session")
def etcd_process(tmp_path_factory):
    try:
        binary = etcd_binary()
    except (RuntimeError, OSError) as exc:
        pytest.fail(f"the etcd backend tests need etcd (make etcd): {exc}")
    proc = EtcdProcess(binary, str(tmp_path_factory.mktemp("etcd")))
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(params=["embedded", "etcd"])
def backend(request):
    return open_backend(request, request.param)
