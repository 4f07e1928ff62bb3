"""The engine contract tests (tests/engines/): vLLM's and SGLang's own MoE dispatch code run
on moecomm's deep_ep / nixl_ep, in rank processes that import the engines from the engine
environment (tools/engines_env.sh; engine_env.py). The pytest process itself never imports an
engine.

Without the environment these tests skip, saying how to make it, except under
MOECOMM_REQUIRE_ENGINES=1 (set by `make test`, which builds the environment first): there a
missing or stale environment fails them, so CI cannot pass by skipping."""

from __future__ import annotations

import pytest
import rank_group
from engine_checks import engines_or_skip


@pytest.fixture(scope="module")
def engine_group(tmp_path_factory):
    """`run(module, names, num_ranks)`: the group's results, run once per module and size."""
    engines_or_skip()
    cache: dict = {}

    def run(module: str, names: list[str], num_ranks: int) -> dict:
        key = (module, tuple(names), num_ranks)
        if key not in cache:
            workdir = str(tmp_path_factory.mktemp(f"{module}-{num_ranks}"))
            cache[key] = rank_group.run_group(module, names, num_ranks, workdir)
        return cache[key]

    return run
