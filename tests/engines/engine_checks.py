"""Shared by the engine tests: the environment check (skip, or fail under
MOECOMM_REQUIRE_ENGINES=1) and the outcome check of a scenario. A module of its own, not the
conftest: two conftest.py files (tests/, tests/engines/) cannot both be imported as `conftest`."""

from __future__ import annotations

import os

import engine_env
import pytest
import rank_group

REQUIRE = os.environ.get("MOECOMM_REQUIRE_ENGINES") == "1"


def engines_or_skip() -> None:
    why = engine_env.why_unavailable()
    if why is None:
        return
    if REQUIRE:
        pytest.fail(f"MOECOMM_REQUIRE_ENGINES=1 and {why}", pytrace=False)
    pytest.skip(why)


def check(results: dict, name: str) -> None:
    failure = rank_group.outcome_of(results, name)
    if failure is not None:
        pytest.fail(f"{name}: {failure}", pytrace=False)
