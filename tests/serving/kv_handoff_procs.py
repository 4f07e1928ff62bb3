"""Processes for tests/serving/disagg/test_kv_handoff.py: a prefill side that sends KV packages
with a KvOutbox, and a decode side (KvInbox behind an HTTP server), started with multiprocessing's
spawn, or as scripts in network namespaces (``python kv_handoff_procs.py ns-inbox|ns-sender
CONFIG.json``)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

# Every wait of a child: long enough for a loaded 2-core machine, short enough that a lost
# parent does not leave a child behind for long.
CHILD_WAIT_S = 60.0
# Sent before the package list: a package spec is ("bytes", n) or ("kv0",) (a sequence of length
# 0, encoded: its keys and values have no blocks).
EMPTY_KV = ("kv0",)


def pattern(seed: int, index: int, n: int) -> torch.Tensor:
    """The bytes of package `index` of sender `seed`: both ends regenerate them to compare."""
    g = torch.Generator().manual_seed(seed * 100_003 + index)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def empty_kv_package():
    from moecomm_serving.kv.blocks import BlockPool, PagedSequence
    from moecomm_serving.kv.package import pack

    pool = BlockPool([0, 1], kv_heads=2, k_dim=4, v_dim=4, dtype=torch.float16, device="cpu")
    return pack(PagedSequence(pool).export_blocks())


def make(seed: int, index: int, spec) -> torch.Tensor:
    from moecomm_serving.kv.package import encode_package

    if tuple(spec) == EMPTY_KV:
        return encode_package(empty_kv_package(), f"h{seed}-{index}")
    return pattern(seed, index, int(spec[1]))


def sender_main(conn, url: str, seed: int, specs: list, transport: str = "shm") -> None:
    """Sends every package of `specs` to `url`, reporting ("sent", index, client_id, tag) after
    each; then ("done",) and waits for the parent's "exit"."""
    from moecomm_serving.disagg.staged import KvOutbox

    out = KvOutbox(transport)
    try:
        for i, spec in enumerate(specs):
            cid, tag = out.send(url, make(seed, i, spec))
            conn.send(("sent", i, cid, tag))
        conn.send(("done", out.connected()))
    except Exception as e:  # the test reads what the sender saw
        conn.send(("error", f"{type(e).__name__}: {e}"))
    conn.poll(CHILD_WAIT_S)
    out.close()


def inbox_main(conn, slot_bytes: int, num_slots: int) -> None:
    """A decode side: a KvInbox behind an HTTP server; sends its URL, serves until "stop"."""
    from fastapi import FastAPI
    from moecomm.http_thread import HttpServer
    from moecomm_serving.disagg.staged import KvInbox, install_kv_routes

    inbox = KvInbox("shm", slot_bytes=slot_bytes, num_slots=num_slots).start()
    app = FastAPI()
    install_kv_routes(app, lambda: inbox)
    server = HttpServer(app, what="the KV inbox's HTTP server")
    conn.send(server.start())
    conn.poll(CHILD_WAIT_S)
    server.stop()
    inbox.close()


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


# ------------------------------------------------------------------ network-namespace scripts
def ns_inbox(cfg: dict) -> None:
    """The decode side in its namespace: takes the packages the sender lists in its result
    file, writes their hashes and the inbox's stats, then exits."""
    from fastapi import FastAPI
    from moecomm.http_thread import HttpServer
    from moecomm_serving.disagg.staged import KvInbox, install_kv_routes

    inbox = KvInbox("auto", host=cfg["host"], slot_bytes=cfg["slot_bytes"], num_slots=2).start()
    app = FastAPI()
    install_kv_routes(app, lambda: inbox)
    server = HttpServer(app, host=cfg["host"], port=cfg["port"])
    server.start()
    print("kv inbox listening", flush=True)
    sent = Path(cfg["sent"])
    deadline = time.monotonic() + CHILD_WAIT_S
    while not sent.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    got = json.loads(sent.read_text())
    hashes = [sha(inbox.take(cid, tag, CHILD_WAIT_S)) for cid, tag in got["keys"]]
    Path(cfg["out"] + ".tmp").write_text(json.dumps({"hashes": hashes, "stats": inbox.stats}))
    os.replace(cfg["out"] + ".tmp", cfg["out"])
    server.stop()
    inbox.close()


def ns_sender(cfg: dict) -> None:
    from moecomm_serving.disagg.staged import KvOutbox

    out = KvOutbox("auto", host=cfg["host"])
    keys = [out.send(cfg["url"], pattern(cfg["seed"], i, n)) for i, n in enumerate(cfg["sizes"])]
    result = {"keys": keys, "transports": out.connected()}
    Path(cfg["sent"] + ".tmp").write_text(json.dumps(result))
    os.replace(cfg["sent"] + ".tmp", cfg["sent"])
    # Stay until the inbox took everything: a sender that exits is dropped by its peer.
    deadline = time.monotonic() + CHILD_WAIT_S
    while not Path(cfg["out"]).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    out.close()
    print("kv sender done", flush=True)


if __name__ == "__main__":
    role, path = sys.argv[1], sys.argv[2]
    {"ns-inbox": ns_inbox, "ns-sender": ns_sender}[role](json.loads(Path(path).read_text()))
