"""Chaos tests: slot poisoning on in every process they spawn, and the run's figures printed
(and written as JSON to $MOECOMM_CHAOS_JSON) at the end."""

from __future__ import annotations

import pytest
from chaos_figures import FIGURES
from chaos_model import Reference

# Debug mode of the slot protocol: a released slot is overwritten with a poison pattern, so a
# read after release fails every time instead of once in a while. Read by each process at
# import, so it is set before any server or client is spawned.
POISON_ENV = "MOECOMM_POISON_SLOTS"


@pytest.fixture(autouse=True)
def poisoned_slots(monkeypatch):
    monkeypatch.setenv(POISON_ENV, "1")


@pytest.fixture(scope="session")
def reference():
    """The fault-free answers, computed in the test process (the servers' weights rebuilt from
    the same seed)."""
    return Reference()


def pytest_terminal_summary(terminalreporter):
    if not FIGURES.trials:
        return
    terminalreporter.section("moecomm chaos figures")
    for line in FIGURES.lines():
        terminalreporter.write_line(line)
    path = FIGURES.write_json()
    if path:
        terminalreporter.write_line(f"written to {path}")
