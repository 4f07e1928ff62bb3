"""Stage supervision in `moecomm frontend --stages 2` (real processes, real HTTP): a stage
process killed with SIGKILL, or stopped with SIGSTOP, in the middle of streamed and non-streamed
requests is replaced; every request completes, with the tokens the in-process model generates
(greedy, and seeded sampling), i.e. those of a fault-free run. Each engine step goes as two
micro-batches in flight, so the overlapped path is served through the same API too."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import pytest
from frontend_helpers import MODEL_NAME
from moecomm.testing import FrontendSpec, Proc, start_local_cluster
from proc_helpers import stop_process

# A request's deadline: covers a restart of the stages (a few seconds) on a loaded machine.
TIMEOUT_S = 90.0
HOSTED = ("0-11", "4-15")
STEP_TOKENS = 32
PROMPTS = ("a stage dies mid-stream", "and every request still completes " * 2)
# Long enough that the fault lands mid-stream: the victim is hit after KILL_AFTER tokens.
MAX_NEW = 24
KILL_AFTER = 3
SAMPLED = {"temperature": 0.8, "top_p": 0.9, "seed": 11}


def stage_pids(fe: Proc) -> list[int]:
    """The serving pipeline's stage pids: the front end prints them at start and after every
    replacement."""
    last = fe.wait_output("pipeline stage pids: ", 1, 0)[-1]
    return [int(p) for p in last.split(": ")[1].split()]


@pytest.fixture(scope="module")
def frontend(tiny_dir):
    # Two micro-batches in flight per step: a fault also lands while both stages are busy.
    args = ("--stages", "2", "--max-batch-tokens", str(STEP_TOKENS), "--stage-micro-batches", "2")
    with start_local_cluster(
        tiny_dir,
        servers=HOSTED,
        frontends=[FrontendSpec(args=args)],
        model_name=MODEL_NAME,
        id_prefix="fe-recover",
    ) as cluster:
        # the front end first at teardown (its stages still use the servers); every stage
        # process is in its group: stopped and reaped with it
        yield cluster.frontends[0]


def _bodies():
    """(body, streamed) of every request: each prompt greedy and sampled, streamed and not."""
    out = []
    for p in PROMPTS:
        for params in ({"temperature": 0.0}, SAMPLED):
            for stream in (True, False):
                body = {"model": MODEL_NAME, "prompt": p, "max_tokens": MAX_NEW, **params}
                body.update(ignore_eos=True, return_token_ids=True, stream=stream)
                out.append(body)
    return out


async def _serve_through(url: str, fault) -> tuple[list[list[int]], int]:
    """Sends every request at once; calls `fault()` when the first stream has KILL_AFTER
    tokens. Returns each request's tokens and how many the first stream had at the fault."""
    hit, at_fault = asyncio.Event(), []

    async def streamed(c, body, first):
        ids = []
        async with c.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT_S) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                assert "error" not in chunk, chunk
                ids += chunk["choices"][0].get("token_ids") or []
                if first and len(ids) >= KILL_AFTER and not hit.is_set():
                    at_fault.append(len(ids))
                    fault()
                    hit.set()
        return ids

    async def whole(c, body):
        r = await c.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT_S)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    async with httpx.AsyncClient() as c:
        bodies = _bodies()
        first = next(i for i, b in enumerate(bodies) if b["stream"])
        jobs = [
            streamed(c, b, i == first) if b["stream"] else whole(c, b) for i, b in enumerate(bodies)
        ]
        got = await asyncio.gather(*jobs)
    assert at_fault, "the fault was never injected"
    return got, at_fault[0]


def _expected(tok, solo) -> list[list[int]]:
    out = []
    for body in _bodies():
        params = {k: body[k] for k in ("temperature", "top_p", "seed") if k in body}
        out.append(
            solo(tok.encode(body["prompt"]), max_new_tokens=MAX_NEW, ignore_eos=True, **params)
        )
    return out


def _check_replaced(fe: Proc, before: list[int], restarts: int, victim: int) -> None:
    fe.wait_output("pipeline restarted", restarts, TIMEOUT_S)
    after = stage_pids(fe)
    assert not set(after) & set(before), (before, after)  # all new processes
    with pytest.raises(ProcessLookupError):  # the victim is gone for good (reaped by the driver)
        os.kill(before[victim], 0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim", [1, 0])
def test_killed_stage_is_replaced_and_every_request_completes(frontend, tok, solo, victim):
    restarts = len([ln for ln in frontend.lines() if ln.startswith("pipeline restarted")])
    before = stage_pids(frontend)
    got, at_fault = asyncio.run(
        _serve_through(frontend.url, lambda: os.kill(before[victim], signal.SIGKILL))
    )
    assert at_fault < MAX_NEW  # the stage died mid-stream
    assert got == _expected(tok, solo)
    _check_replaced(frontend, before, restarts + 1, victim)


@pytest.mark.timeout(300)
def test_stopped_stage_is_replaced_and_every_request_completes(frontend, tok, solo):
    restarts = len([ln for ln in frontend.lines() if ln.startswith("pipeline restarted")])
    before = stage_pids(frontend)
    got, at_fault = asyncio.run(_serve_through(frontend.url, lambda: stop_process(before[0])))
    assert at_fault < MAX_NEW
    assert got == _expected(tok, solo)
    _check_replaced(frontend, before, restarts + 1, 0)
    lost = frontend.wait_output("pipeline stage lost", restarts + 1, 0)[-1]
    assert f"stage 0 (pid {before[0]}) stopped" in lost, lost
