"""Chaos tests: slot poisoning on in every process they spawn, and the run's figures printed
(and written as JSON to $MOECOMM_CHAOS_JSON: the expert-server trials under "summary" and
"trials", the whole-deployment trials under "deployment") at the end."""

from __future__ import annotations

import json

import pytest
from chaos_figures import FIGURES, json_path
from chaos_model import Reference
from deployment_figures import DEPLOY_FIGURES

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
    if not FIGURES.trials and not DEPLOY_FIGURES.trials:
        return
    terminalreporter.section("moecomm chaos figures")
    if FIGURES.trials:
        for line in FIGURES.lines():
            terminalreporter.write_line(line)
    if DEPLOY_FIGURES.trials:
        for line in DEPLOY_FIGURES.lines():
            terminalreporter.write_line(line)
    path = json_path()
    if path:
        out = {"summary": FIGURES.summary(), "trials": FIGURES.trials} if FIGURES.trials else {}
        if DEPLOY_FIGURES.trials:
            out["deployment"] = {
                "summary": DEPLOY_FIGURES.summary(),
                "trials": DEPLOY_FIGURES.trials,
            }
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        terminalreporter.write_line(f"written to {path}")
