"""Runs a test file's scenarios on groups of rank processes, once per group size: each rank
runs `rank_main(rank, num_ranks, store_path, conn)` and sends {scenario: (outcome, seconds)}
("ok" or a traceback), or {"setup": (...)} when it could not start. Every process is killed and
its shared memory reaped at the end, pass or fail."""

from __future__ import annotations

import time

import moecomm
from moecomm import prefork


def launch(rank_main, num_ranks: int, store_path: str, procs: list, timeout: float) -> list:
    ctx = prefork.process_context()
    conns = []
    for r in range(num_ranks):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=rank_main, args=(r, num_ranks, store_path, child), daemon=True)
        procs.append(p)
        p.start()
        child.close()
        conns.append(parent)
    deadline = time.monotonic() + timeout
    results = []
    for r, conn in enumerate(conns):
        if not conn.poll(max(deadline - time.monotonic(), 0.0)):
            raise AssertionError(f"rank {r} of {num_ranks} gave no result in {timeout} s")
        try:
            results.append(conn.recv())
        except EOFError:  # died: say how, instead of a bare EOFError
            procs[-num_ranks + r].join(5)
            code = procs[-num_ranks + r].exitcode
            results.append({"setup": (f"rank {r} died without a result (exit code {code})",)})
    return results


def run_groups(rank_main, sizes, scenarios, tmp_path_factory, tag: str, timeout: float) -> dict:
    """{(num_ranks, scenario): [outcome of each rank]} for every group size in `sizes`."""
    out, procs = {}, []
    try:
        for num_ranks in sizes:
            path = str(tmp_path_factory.mktemp(f"{tag}{num_ranks}") / "store")
            results = launch(rank_main, num_ranks, path, procs, timeout)
            for name in scenarios:
                out[num_ranks, name] = [
                    r.get(name, r.get("setup", ("not run (an earlier one failed)",)))
                    for r in results
                ]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()  # a forked one may be reaped already
            p.join(5)
            moecomm.reap_stale_segments(p.pid)
    return out
