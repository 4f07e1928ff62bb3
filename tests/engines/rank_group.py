"""Runs a scenario module's scenarios in one group of rank processes: spawned, one gloo process
group on loopback (a FileStore: no port to pick), every scenario in order on every rank with a
barrier between them, each rank sending one result per scenario as soon as it ends. The parent
waits for each with a deadline; a rank that hangs or dies ends the group (the scenarios left
are reported "not run", by name). Every process is killed and its shared memory reaped at the
end, pass or fail.

A scenario module defines ``SCENARIOS = {name: fn(ctx)}`` and may define ``setup(ctx)`` (run
once after the process group, e.g. vLLM's parallel state) and ``teardown(ctx)``. A scenario
that sets ``ctx.state["die"]`` ends its rank with SIGKILL right after reporting (a crash under
test); one that sets ``ctx.state["group_broken"]`` skips the barriers from then on. Put such a
scenario last: the group ends with it. Importing it
imports the engine (the slow part: ~10 s per process on the CI machine)."""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import importlib
import os
import signal
import time
import traceback

import moecomm
from moecomm import prefork

OK = "ok"
SETUP_DEADLINE_S = 180.0  # importing vLLM or SGLang in every rank at once, on 2 cores
SCENARIO_DEADLINE_S = float(os.environ.get("MOECOMM_ENGINES_DEADLINE_S", "90"))
TEARDOWN_DEADLINE_S = 30.0
GLOO_TIMEOUT_S = 120.0


@dataclasses.dataclass
class Ctx:
    rank: int
    num_ranks: int
    workdir: str
    group: object = None  # torch.distributed.group.WORLD
    state: dict = dataclasses.field(default_factory=dict)


def _rank_main(rank, num_ranks, workdir, module_name, names, conn) -> None:
    os.environ.update(GLOO_SOCKET_IFNAME="lo", RANK=str(rank), WORLD_SIZE=str(num_ranks))
    os.environ.setdefault("LOCAL_RANK", "0")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent's "where are you?"
    t0 = time.monotonic()
    try:
        import engine_env

        engine_env.activate()
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.FileStore(os.path.join(workdir, "store"), num_ranks)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=num_ranks,
            timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S),
        )
        ctx = Ctx(rank, num_ranks, workdir, dist.group.WORLD)
        module = importlib.import_module(module_name)
        if hasattr(module, "setup"):
            module.setup(ctx)
    except BaseException:
        conn.send(("setup", traceback.format_exc(), time.monotonic() - t0))
        return
    conn.send(("setup", OK, time.monotonic() - t0))
    for name in names:
        t = time.monotonic()
        try:
            module.SCENARIOS[name](ctx)
            outcome = OK
        except BaseException:
            outcome = traceback.format_exc()
        conn.send((name, outcome, time.monotonic() - t))
        if ctx.state.get("die"):  # a scenario's victim: gone at once, as under kill -9
            os.kill(os.getpid(), signal.SIGKILL)
        if ctx.state.get("group_broken"):  # a peer is gone: no more collectives
            break
        dist.barrier()
    if ctx.state.get("group_broken"):
        conn.send(("done", OK, time.monotonic() - t0))
        return
    if hasattr(module, "teardown"):
        module.teardown(ctx)
    conn.send(("done", OK, time.monotonic() - t0))
    dist.destroy_process_group()


def run_group(
    module_name: str,
    names: list[str],
    num_ranks: int,
    workdir: str,
    *,
    setup_deadline: float = SETUP_DEADLINE_S,
    scenario_deadline: float = SCENARIO_DEADLINE_S,
) -> dict:
    """{scenario: [outcome of each rank]} plus {"setup": [...], "seconds": {...}}; an outcome is
    OK or a traceback / reason."""
    ctx = prefork.process_context()
    procs, conns = [], []
    results = {name: [f"not run: {name} was not reached"] * num_ranks for name in names}
    seconds: dict[str, float] = {}
    try:
        for r in range(num_ranks):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_rank_main,
                args=(r, num_ranks, workdir, module_name, names, child),
                daemon=True,
                name=f"{module_name}-rank{r}",
            )
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)
        stages = [("setup", setup_deadline)] + [(n, scenario_deadline) for n in names]
        stages.append(("done", TEARDOWN_DEADLINE_S))
        for stage, limit in stages:
            deadline = time.monotonic() + limit
            outcomes = []
            for r, conn in enumerate(conns):
                if not conn.poll(max(deadline - time.monotonic(), 0.0)):
                    outcomes.append(f"rank {r} gave no result for {stage} in {limit:.0f} s")
                    if procs[r].is_alive():  # its stacks, on its stderr, before it is killed
                        os.kill(procs[r].pid, signal.SIGUSR1)
                        time.sleep(0.5)
                    continue
                try:
                    got, outcome, secs = conn.recv()
                except EOFError:
                    procs[r].join(5)
                    outcomes.append(f"rank {r} died during {stage} (exit {procs[r].exitcode})")
                    continue
                assert got == stage, f"rank {r} sent {got} while {stage} was expected"
                outcomes.append(outcome)
                seconds[stage] = max(seconds.get(stage, 0.0), secs)
            if stage == "setup":
                if any(o != OK for o in outcomes):
                    why = next(o for o in outcomes if o != OK)
                    results = {n: [f"group setup failed:\n{why}"] * num_ranks for n in names}
                    break
                continue
            if stage == "done":
                break
            results[stage] = outcomes
            if any(o.startswith("rank ") for o in outcomes):  # hung or dead: end the group
                for rest in names[names.index(stage) + 1 :]:
                    results[rest] = [f"not run: the group ended at {stage}"] * num_ranks
                break
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()  # a forked one may be reaped already
            p.join(5)
            moecomm.reap_stale_segments(p.pid)
    results["seconds"] = seconds
    return results


def outcome_of(results: dict, name: str) -> str | None:
    """None when every rank passed `name`, else the first rank's failure, labelled."""
    for r, outcome in enumerate(results[name]):
        if outcome != OK:
            return f"rank {r}: {outcome}"
    return None
