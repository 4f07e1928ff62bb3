"""Fixtures: `backend`, which runs an interface test against both the monitor and etcd (their
session processes live in tests/conftest.py; restart tests restart them in place). Tests keep
apart by unique member ids (monitor) or a unique key prefix (etcd)."""

from __future__ import annotations

import pytest
from membership_procs import open_backend


@pytest.fixture(params=["embedded", "etcd"])
def backend(request):
    return open_backend(request, request.param)
