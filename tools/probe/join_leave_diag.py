"""The join/leave diagnostic: does a peer that joins while a device wait spins get its put seen?

tests/gpu/test_ipc_gpu.py::test_peers_join_and_leave_at_run_time failed on 2026-11-28 (one H200)
in its first loop: the device wait probe timed out although the peer's put_signal returned, and
the test kept only the status. What is unique there: the peer does its first CUDA work (module
load, cudaIpcOpenMemHandle, its first launch) while this process's probe kernel spins on the
same GPU. This script runs the same join four ways, each with a fresh peer process, and prints
per variant what the test lost:

    cold     the peer joins with lazy loading and no preload (MOECOMM_PRELOAD_KERNELS=0)
    warm     the peer loads every kernel first (moecomm.runtime.device_preload)
    nospin   cold peer, but the probe is launched only after the put returned: no spinning
             kernel while the peer does its first CUDA work
    eager    cold peer with CUDA_MODULE_LOADING=EAGER (every module loaded at context creation)

For each: the probe's status, the word it observed, its elapsed time, the word and payload the
host reads back afterwards, and when the peer started, connected (mapped our region) and put,
in seconds relative to the probe's launch (CLOCK_MONOTONIC is one clock for every process of
the machine). One JSON line ``JOIN-LEAVE-DIAG {...}`` at the end (tools/gpu_check_stages.py
reads it); exit 0 when every variant saw its put, 1 when one did not, 2 when it could not run.

    python tools/probe/join_leave_diag.py [--variants cold,warm,nospin,eager]
                                          [--probe-timeout S] [--variant-timeout S]

Runs in about 10-40 s on a GPU (a peer process per variant: spawn and a CUDA context); the
gpu-check's joinleave stage gives it one minute. Without a device it prints why and exits 2.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import time

TAG = "JOIN-LEAVE-DIAG"
VARIANTS = ("cold", "warm", "nospin", "eager")
# The probe's device deadline: a put seen at all is seen in microseconds; seconds separate
# "late" from "never" without spending the stage on one variant.
PROBE_TIMEOUT_S = 4.0
# Per variant: the peer's spawn and CUDA context, the probe's deadline, the read-back.
VARIANT_TIMEOUT_S = 12.0
REGION_BYTES = 1 << 16
PAYLOAD_OFFSET = 4096
PAYLOAD_BYTES = 1000  # not a multiple of 16: the put's tail path, as in the test
SIGNAL_OFFSET = 64
WAIT_EQUAL = "EQUAL"


def pattern(tag: int, n: int) -> bytes:
    return bytes((tag * 31 + i) % 251 for i in range(n))


def peer_env(variant: str) -> dict:
    """The environment a variant's peer starts with (only what differs from ours)."""
    if variant == "warm":
        return {"MOECOMM_PRELOAD_KERNELS": "1"}
    env = {"MOECOMM_PRELOAD_KERNELS": "0"}
    if variant == "eager":
        env["CUDA_MODULE_LOADING"] = "EAGER"
    return env


def peer_main(conn, variant: str) -> None:
    """The joining peer: its own transport and region, then on command maps our region and puts
    with the device put_signal path, reporting monotonic times of each step."""
    times = {"started": time.monotonic()}
    try:
        from moecomm import _C
        from moecomm._cuda import IpcPeerTable, IpcTransport

        report = None
        if variant == "warm":
            import moecomm._cuda as k
            from moecomm.runtime.device_preload import preload_kernels

            report = preload_kernels(k, 0)
        t = IpcTransport()
        own = t.create_region(REGION_BYTES)
        times["ready"] = time.monotonic()
        conn.send(("handle", own.handle, times, report))
        while True:
            cmd, *args = conn.recv()
            if cmd == "connect":
                table = IpcPeerTable(t, own, 1)
                index = table.add_peer(args[0])
                conn.send(("connected", index, time.monotonic()))
            elif cmd == "put_signal":
                offset, data, sig_offset, value = args
                t0 = time.monotonic()
                table.put_signal(0, offset, data, sig_offset, value, _C.SignalOp.SET)
                conn.send(("put", t0, time.monotonic()))
            elif cmd == "exit":
                conn.send(("bye",))
                return
    except Exception as exc:  # reported to the parent, which prints it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


class Variant:
    """One join: a fresh peer process, a fresh region and peer table on our side."""

    def __init__(self, name: str, k, t, probe_timeout_s: float, limit_s: float, tag: int):
        self.name, self.k, self.t, self.tag = name, k, t, tag
        self.probe_timeout_s, self.end = probe_timeout_s, time.monotonic() + limit_s
        self.row: dict = {"name": name, "status": "NOT-RUN"}

    def recv(self, conn, what: str):
        left = self.end - time.monotonic()
        if left <= 0 or not conn.poll(left):
            raise TimeoutError(f"the peer did not answer ({what}) within the variant's time")
        msg = conn.recv()
        if msg[0] == "error":
            raise RuntimeError(f"peer failed ({what}): {msg[1]}")
        return msg

    def run(self) -> dict:
        from moecomm import _C

        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        saved = {k: os.environ.get(k) for k in peer_env(self.name)}
        os.environ.update(peer_env(self.name))
        try:
            proc = ctx.Process(target=peer_main, args=(child, self.name), daemon=True)
            proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        child.close()
        try:
            self._join(parent, _C)
        except Exception as exc:
            self.row["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            if proc.is_alive():
                try:
                    parent.send(("exit",))
                    if parent.poll(2.0):
                        parent.recv()
                except (OSError, EOFError):
                    pass
            proc.join(3.0)
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(3.0)
        self.row["line"] = format_row(self.row)
        return self.row

    def _join(self, conn, _C) -> None:
        k, t, row = self.k, self.t, self.row
        local = t.create_region(REGION_BYTES)
        table = k.IpcPeerTable(t, local, 1)
        _, handle, peer_times, report = self.recv(conn, "its handle")
        row["peer_preload"] = report
        idx = table.add_peer(handle)
        data = pattern(self.tag, PAYLOAD_BYTES)
        timeout_ns = int(self.probe_timeout_s * 1e9)

        def launch():
            return table.launch_wait(
                SIGNAL_OFFSET, getattr(_C.WaitOp, WAIT_EQUAL), self.tag, timeout_ns=timeout_ns,
                peer=idx,
            )  # fmt: skip

        probe, launched = None, None
        if self.name != "nospin":
            probe, launched = launch(), time.monotonic()
        conn.send(("connect", local.handle))
        _, peer_index, connected = self.recv(conn, "connect")
        conn.send(("put_signal", PAYLOAD_OFFSET, data, SIGNAL_OFFSET, self.tag))
        _, put_start, put_done = self.recv(conn, "put_signal")
        if probe is None:
            probe, launched = launch(), time.monotonic()
        rel = {
            "peer_started_s": peer_times["started"] - launched,
            "peer_ready_s": peer_times["ready"] - launched,
            "connected_s": connected - launched,
            "put_start_s": put_start - launched,
            "put_done_s": put_done - launched,
        }
        row.update({key: round(v, 4) for key, v in rel.items()})
        row["peer_index"] = peer_index
        while not probe.done():
            if time.monotonic() > self.end:
                row["status"] = "HUNG"
                row["error"] = "the probe kernel did not finish within the variant's time"
                return
            time.sleep(0.001)
        result = probe.result()
        row["elapsed_s"] = round(time.monotonic() - launched, 4)
        row["status"] = str(result["status"]).rsplit(".", 1)[-1]
        row["observed"] = int(result["observed"])
        row["word"] = int(t.load(local, SIGNAL_OFFSET))
        got = t.read(local, PAYLOAD_OFFSET, PAYLOAD_BYTES)
        row["payload_ok"] = got == data
        if got != data:
            first = next(i for i, (a, b) in enumerate(zip(got, data, strict=True)) if a != b)
            row["payload_first_mismatch"] = {"at": first, "got": got[first], "want": data[first]}
        row["want"] = self.tag


def format_row(row: dict) -> str:
    """One line per variant, the fields the failed test lost."""
    if "status" not in row or (row["status"] == "NOT-RUN" and "error" in row):
        return f"{row['name']:<7} NOT-RUN: {row.get('error', '')}"
    parts = [f"{row['name']:<7} status={row['status']}"]
    if "observed" in row:
        parts.append(f"observed=0x{row['observed']:x} (want 0x{row['want']:x})")
    if "elapsed_s" in row:
        parts.append(f"elapsed={row['elapsed_s']:.3f}s")
    if "word" in row:
        ok = "ok" if row.get("payload_ok") else f"BAD {row.get('payload_first_mismatch')}"
        parts.append(f"host read-back: word=0x{row['word']:x} payload={ok}")
    times = [
        f"{label}={row[key]:+.3f}s"
        for key, label in (
            ("peer_started_s", "peer started"),
            ("peer_ready_s", "ready"),
            ("connected_s", "connected"),
            ("put_start_s", "put"),
            ("put_done_s", "put returned"),
        )
        if key in row
    ]
    if times:
        parts.append("vs probe launch: " + ", ".join(times))
    if row.get("peer_preload"):
        pre = row["peer_preload"]
        parts.append(
            f"peer preloaded {pre.get('functions')} functions in {pre.get('seconds'):.3f}s"
        )
    if row.get("error"):
        parts.append(f"error: {row['error']}")
    return "  ".join(parts)


def verdict(rows: list[dict]) -> int:
    """0 when every variant's probe saw its put, else 1."""
    return 0 if rows and all(r.get("status") == "OK" for r in rows) else 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, in order")
    ap.add_argument("--probe-timeout", type=float, default=PROBE_TIMEOUT_S)
    ap.add_argument("--variant-timeout", type=float, default=VARIANT_TIMEOUT_S)
    a = ap.parse_args(argv)
    a.variants = [v for v in a.variants.split(",") if v]
    unknown = [v for v in a.variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant {', '.join(unknown)}: one of {', '.join(VARIANTS)}")
    if not 0 < a.probe_timeout < a.variant_timeout:
        ap.error("need 0 < --probe-timeout < --variant-timeout")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    info: dict = {"variants": [], "probe_timeout_s": a.probe_timeout}
    try:
        import moecomm.wire.cuda as gpu

        if not gpu.available():
            raise RuntimeError(f"no CUDA device: {gpu.why_unavailable()}")
        k = gpu.cuda_module()
        from moecomm.runtime.device_preload import preload_kernels

        # The waiting side is warm in every variant: only the joining peer differs.
        info["our_preload"] = preload_kernels(k, 0)
        t = k.IpcTransport()
    except Exception as exc:
        info["error"] = f"{type(exc).__name__}: {exc}"
        print(f"join/leave diagnostic cannot run: {info['error']}", flush=True)
        print(f"{TAG} {json.dumps(info)}", flush=True)
        return 2
    for i, name in enumerate(a.variants):
        row = Variant(name, k, t, a.probe_timeout, a.variant_timeout, tag=11 + i).run()
        print(row["line"], flush=True)
        info["variants"].append(row)
    code = verdict(info["variants"])
    print(f"{TAG} {json.dumps(info, default=str)}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
