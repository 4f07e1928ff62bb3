"""Without etcd and without a way to install it, the etcd tests fail with a clear message."""

from __future__ import annotations

import membership_procs
import pytest


def test_missing_etcd_that_cannot_be_installed_is_an_error(monkeypatch):
    monkeypatch.setattr(membership_procs.shutil, "which", lambda name, path=None: None)
    monkeypatch.setattr(membership_procs.os, "geteuid", lambda: 1000)  # not root: no apt-get
    with pytest.raises(RuntimeError, match="etcd is not installed and cannot be"):
        membership_procs.etcd_binary()


def test_failed_install_reports_apt_output(monkeypatch):
    monkeypatch.setattr(membership_procs.os, "geteuid", lambda: 0)
    # etcd missing, apt-get present: the install runs and fails.
    monkeypatch.setattr(
        membership_procs.shutil,
        "which",
        lambda name, path=None: None if name == "etcd" else f"/usr/bin/{name}",
    )

    class Failed:
        returncode = 100
        stderr = "E: Unable to locate package etcd-server"

    monkeypatch.setattr(membership_procs.subprocess, "run", lambda *a, **kw: Failed())
    with pytest.raises(RuntimeError, match="Unable to locate package"):
        membership_procs.etcd_binary()
