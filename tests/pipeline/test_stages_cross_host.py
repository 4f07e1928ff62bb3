"""Pipeline stages on other hosts, without a cluster: the driver and the stage agents each run in a
network namespace of their own (moecomm.netns: a private /dev/shm and PID namespace each), so
stages on different "hosts" can only talk over the network. Each pair of stages picks its
transport as the runtime does (shm when they share /dev/shm, nixl across), KV caches migrate
across hosts when the layer map changes, greedy tokens equal one process, and a stage host
killed mid-run is a clear PipelineError naming the stage, in well under the step deadline."""

from __future__ import annotations

import json
import secrets
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from lab_procs import start_logged, wait_for_log, wait_ready
from moecomm import netns
from moecomm.pipeline.testing import expected_token
from moecomm.testing import Processes
from moecomm.wire.nixl import available as nixl_available

lab_ok, lab_why = netns.available()
nixl_ok, nixl_why = nixl_available()
pytestmark = [
    pytest.mark.skipif(not lab_ok, reason=f"network namespaces cannot be made: {lab_why}"),
    pytest.mark.skipif(not nixl_ok, reason=f"NIXL is not installed: {nixl_why}"),
]

PY = [sys.executable, "-X", "faulthandler"]
AGENT_PORT = 7400
# Importing torch and moecomm in a fresh interpreter on a loaded 2-core machine.
START_S = 120.0
# The driver's whole run (stage start-up included) in its namespace.
DRIVER_S = 240.0
FAKE_LAYERS, FAKE_STAGES = 8, 4
FAKE_PROMPTS = [[3, 9, 4], [17], [5, 5], [40, 41, 42, 43]]
FAKE_NEW = 8
# Submission index -> k: one layer moves off the last stage and back, crossing hosts each time.
FAKE_FORCED = {3: 1, 8: 0, 12: 1}
MODEL_NEW = 10
MODEL_PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(3 + 2 * i)] for i in range(4)]
MODEL_FORCED = {3: 2, 9: 1, 15: 0}
# A host killed must be reported long before the step deadline (60 s): the driver sees the
# stage's TCP connection close at once; the slack is for a loaded 2-core machine.
KILL_REPORT_S = 15.0

# Runs in the front end's namespace: a pipeline with stage 0 here and the others under the
# agents, a decode through layer-map changes, then (fake mode) a decode that must fail once the
# test has killed a stage host.
DRIVER = r"""
import functools, json, os, sys, time


def main():
    args = json.load(open(sys.argv[1]))
    from moecomm.pipeline.driver import Pipeline, PipelineError, run_decode
    from moecomm.wire.protocol import SlotLayout
    if args["mode"] == "fake":
        from moecomm.pipeline.testing import make_fake_stage
        layout = SlotLayout(max_tokens=64, hidden=8, topk=1, encoding="f32", out_encoding="f32")
        pipe = Pipeline(functools.partial(make_fake_stage, None, None), args["layers"],
                        len(args["places"]), layout, k_max=1, num_slots=2,
                        stage_hosts=args["places"], host=args["host"], stage_token=args["token"])
    else:
        from moecomm_serving.engine.stages import model_pipeline
        pipe = model_pipeline(args["ckpt"], len(args["places"]), stage_hosts=args["places"],
                              host=args["host"], stage_token=args["token"])
    out = {"transports": {f"{i}-{j}": t for (i, j), t in pipe.transports.items()}}
    try:
        forced = {int(k): v for k, v in args["forced"].items()}
        run = run_decode(pipe, args["prompts"], args["new"], forced=forced)
        out.update(tokens=run.tokens, remaps=run.remaps, step_ks=run.step_ks)
        if args["mode"] == "fake":
            print("decoded", flush=True)
            deadline = time.monotonic() + 60
            while not os.path.exists(args["flag"]) and time.monotonic() < deadline:
                time.sleep(0.05)
            t0 = time.monotonic()
            try:
                run_decode(pipe, args["prompts"], args["new"])
                out["error"] = None
            except PipelineError as e:
                out.update(error=str(e), stage=e.stage, seconds=time.monotonic() - t0)
    finally:
        pipe.close()
    json.dump(out, open(args["out"], "w"))
    print("driver done", flush=True)


if __name__ == "__main__":  # the local stage is spawned: it re-imports this file
    main()
"""


def start_agent(lab, host, token_file: Path, log: Path):
    argv = [*PY, "-m", "moecomm.pipeline.agent", "--host", host.addr, "--port", str(AGENT_PORT)]
    p = start_logged(lab, host, [*argv, "--token-file", str(token_file)], log)
    wait_ready(log, p, time.monotonic() + START_S)
    return p


def run_driver(lab, fe, args: dict, tmp_path: Path, on_decoded=None) -> dict:
    script, cfg = tmp_path / "driver.py", tmp_path / "driver.json"
    script.write_text(DRIVER)
    cfg.write_text(json.dumps(args))
    log = tmp_path / "driver.log"
    d = start_logged(lab, fe, [*PY, str(script), str(cfg)], log)
    if on_decoded is not None:
        wait_for_log(log, "decoded", d, time.monotonic() + DRIVER_S)
        on_decoded()
    try:
        rc = d.wait(timeout=DRIVER_S)
    except Exception:
        pytest.fail(f"driver did not finish: {log.read_text()[-3000:]}")
    assert rc == 0, log.read_text()[-3000:]
    return json.loads(Path(args["out"]).read_text())


def token_file(tmp_path: Path) -> tuple[str, Path]:
    token = secrets.token_hex(32)
    path = tmp_path / "stage.key"
    path.write_text(token)
    path.chmod(0o600)
    return token, path


@pytest.mark.timeout(300)
def test_stages_on_three_hosts_migrate_kv_and_a_killed_host_is_a_clear_error(tmp_path):
    """Four stages: 0 in the driver's namespace, 1 and 2 under one agent (they share its
    /dev/shm, so they speak shm), 3 under another; everything across namespaces speaks nixl."""
    token, key = token_file(tmp_path)
    flag = tmp_path / "killed"
    with netns.Lab() as lab:
        fe, a, b = (lab.add_host(n) for n in ("fe", "a", "b"))
        agent_a = start_agent(lab, a, key, tmp_path / "a.log")
        agent_b = start_agent(lab, b, key, tmp_path / "b.log")
        places = [
            "local",
            f"{a.addr}:{AGENT_PORT}",
            f"{a.addr}:{AGENT_PORT}",
            f"{b.addr}:{AGENT_PORT}",
        ]
        args = {
            "mode": "fake",
            "layers": FAKE_LAYERS,
            "places": places,
            "host": fe.addr,
            "token": token,
            "prompts": FAKE_PROMPTS,
            "new": FAKE_NEW,
            "forced": FAKE_FORCED,
            "out": str(tmp_path / "out.json"),
            "flag": str(flag),
        }

        def kill_b():
            lab.kill(agent_b)  # SIGKILL to the whole host: agent and its stage
            agent_b.wait(10)
            flag.write_text("1")

        got = run_driver(lab, fe, args, tmp_path, on_decoded=kill_b)
        assert agent_a.poll() is None  # the other host's agent outlives the failed pipeline
    print(json.dumps({k: got[k] for k in ("error", "stage", "seconds")}))

    want = []
    for p in FAKE_PROMPTS:
        toks, last = [], p[-1]
        for _ in range(FAKE_NEW):
            last = expected_token(last, FAKE_LAYERS)
            toks.append(last)
        want.append(toks)
    assert got["tokens"] == want
    assert [k for _, k in got["remaps"]] == [1, 0, 1]
    assert set(got["step_ks"]) == {0, 1}  # steps ran under both maps: the KV crossed hosts
    # The per-peer choice: shm only between the two stages that share a host.
    pairs = {(i, j) for i in range(FAKE_STAGES) for j in range(FAKE_STAGES) if i != j}
    assert got["transports"] == {
        f"{i}-{j}": "shm" if {i, j} == {1, 2} else "nixl" for i, j in sorted(pairs)
    }
    assert got["error"] is not None, "the pipeline kept running without stage 3's host"
    assert got["stage"] == 3, got["error"]
    assert "stage 3 on" in got["error"] and "closed its control connection" in got["error"]
    assert got["seconds"] < KILL_REPORT_S, got


@pytest.mark.timeout(300)
def test_model_stages_on_three_hosts_equal_one_process(nine_layer_dir, tmp_path):
    from moecomm_serving.engine.generate import generate
    from moecomm_serving.model.transformer import load_model
    from moecomm_serving.types import SamplingParams

    token, key = token_file(tmp_path)
    with netns.Lab() as lab:
        fe, a, b = (lab.add_host(n) for n in ("fe", "a", "b"))
        start_agent(lab, a, key, tmp_path / "a.log")
        start_agent(lab, b, key, tmp_path / "b.log")
        args = {
            "mode": "model",
            "ckpt": str(nine_layer_dir),
            "places": ["local", f"{a.addr}:{AGENT_PORT}", f"{b.addr}:{AGENT_PORT}"],
            "host": fe.addr,
            "token": token,
            "prompts": MODEL_PROMPTS,
            "new": MODEL_NEW,
            "forced": MODEL_FORCED,
            "out": str(tmp_path / "out.json"),
        }
        got = run_driver(lab, fe, args, tmp_path)
    model = load_model(nine_layer_dir, dtype=torch.float32)
    params = SamplingParams(max_new_tokens=MODEL_NEW, ignore_eos=True)
    want = [g.tokens for g in generate(model, MODEL_PROMPTS, params)]
    assert got["tokens"] == want
    assert [k for _, k in got["remaps"]] == [2, 1, 0]
    assert set(got["step_ks"]) == {0, 1, 2}
    assert set(got["transports"].values()) == {"nixl"}


# ---------------------------------------------------------------------------- one host, no lab

# An agent stopping: its stages' grace (2 s), then the interpreter's exit, which takes seconds
# on a 2-core machine shared with other test processes.
AGENT_STOP_S = 30.0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def local_agent(tmp_path):
    """A stage agent on 127.0.0.1 (this host: its stages share our /dev/shm)."""
    token, key = token_file(tmp_path)
    argv = [*PY, "-m", "moecomm.pipeline.agent", "--host", "127.0.0.1", "--port", "0"]
    with Processes(tmp_path / "procs") as procs:
        p = procs.start("agent", [*argv, "--token-file", str(key)], timeout=START_S)
        yield p.ready["address"], token
        code = p.stop(signal.SIGTERM, AGENT_STOP_S)
        assert code == 0, p.tail(2000)


@pytest.mark.timeout(300)
def test_a_stage_under_an_agent_on_this_host_speaks_shm(local_agent):
    import functools

    from moecomm.pipeline.driver import Pipeline, run_decode
    from moecomm.pipeline.testing import make_fake_stage
    from moecomm.wire.protocol import SlotLayout

    addr, token = local_agent
    layout = SlotLayout(max_tokens=64, hidden=8, topk=1, encoding="f32", out_encoding="f32")
    factory = functools.partial(make_fake_stage, None, None)
    with Pipeline(
        factory, 4, 2, layout, k_max=1, stage_hosts=["local", addr], stage_token=token
    ) as pipe:
        run = run_decode(pipe, [[5, 6], [9]], 4, forced={2: 1})
        # Same boot id and each other's probe word readable: shm, as the runtime would pick.
        assert pipe.transports == {(0, 1): "shm", (1, 0): "shm"}
        assert pipe.transport == "auto"
    assert run.tokens == [[6 + 10 * i for i in range(1, 5)], [9 + 10 * i for i in range(1, 5)]]
    assert expected_token(6, 4) == 16  # four layers add 1 + 2 + 3 + 4 per step
    assert [k for _, k in run.remaps] == [1]


@pytest.mark.timeout(300)
def test_wrong_token_and_unreachable_agent_are_clear_errors(local_agent, tmp_path):
    import functools

    from moecomm.pipeline.driver import Pipeline, PipelineError
    from moecomm.pipeline.testing import make_fake_stage
    from moecomm.wire.protocol import SlotLayout

    addr, _ = local_agent
    layout = SlotLayout(max_tokens=64, hidden=8, topk=1, encoding="f32", out_encoding="f32")
    factory = functools.partial(make_fake_stage, None, None)
    # The remote stage comes first, so each refusal comes before any local stage is spawned.
    with pytest.raises(PipelineError, match=r"stage 0: the stage agent at .* refused the token"):
        Pipeline(factory, 4, 2, layout, stage_hosts=[addr, "local"], stage_token="x" * 32)
    with pytest.raises(PipelineError, match=r"cannot reach the stage agent at 127\.0\.0\.1:"):
        Pipeline(
            factory, 4, 2, layout, stage_hosts=[f"127.0.0.1:{free_port()}", "local"],
            stage_token="x" * 32,
        )  # fmt: skip
    with pytest.raises(ValueError, match="need the stage agents' token"):
        Pipeline(factory, 4, 2, layout, stage_hosts=[addr, "local"])
    with pytest.raises(ValueError, match="2 places for 3 stages"):
        Pipeline(factory, 6, 3, layout, stage_hosts=[addr, "local"], stage_token="x" * 32)
    with pytest.raises(ValueError, match="must be HOST:PORT"):
        Pipeline(factory, 4, 2, layout, stage_hosts=["nohost", "local"], stage_token="x" * 32)


def test_frontend_stage_host_options_are_checked(tmp_path):
    import argparse

    from moecomm_serving.cli.frontend_stages import add_stage_host_arguments, stage_placement

    p = argparse.ArgumentParser()
    p.add_argument("--stages", type=int)
    p.add_argument("--host", default="10.0.0.1")
    add_stage_host_arguments(p)
    _, key = token_file(tmp_path)
    short = tmp_path / "short.key"
    short.write_text("abc")
    args = p.parse_args(["--stages", "2", "--stage-hosts", "local,10.0.0.2:7400"])
    with pytest.raises(SystemExit, match="needs --stage-token-file"):
        stage_placement(args)
    args.stage_token_file = str(short)
    with pytest.raises(SystemExit, match="at least 16"):
        stage_placement(args)
    args.stage_token_file = str(key)
    assert stage_placement(args) == ([None, "10.0.0.2:7400"], key.read_bytes().strip())
    args.host = "127.0.0.1"  # the front end's default: remote stages could not reach it
    with pytest.raises(SystemExit, match="needs --host set to this host's address"):
        stage_placement(args)
    args.host = "10.0.0.1"
    args.stage_hosts = "local"
    with pytest.raises(SystemExit, match="1 places for 2 stages"):
        stage_placement(args)
    args.stage_hosts = "local,10.0.0.2"
    with pytest.raises(SystemExit, match="must be HOST:PORT"):
        stage_placement(args)
    assert stage_placement(p.parse_args(["--stages", "2"])) == (None, b"")


# ------------------------------------------------------------------- the command line, two hosts

# Runs in the front end's namespace (the test's own namespace has no route to the lab's): one
# greedy completion through the OpenAI API, written out as JSON.
ASK = r"""
import json, sys
import httpx
url, prompt, n, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True}
r = httpx.Client(trust_env=False).post(f"{url}/v1/completions", json=body, timeout=120)
json.dump({"status": r.status_code, "body": r.json()}, open(out, "w"))
"""
CLI_PROMPT, CLI_NEW, FRONTEND_PORT = "stages on two hosts", 6, 8000


@pytest.mark.timeout(300)
def test_moecomm_frontend_places_a_stage_on_another_host_from_the_command_line(tiny_dir, tmp_path):
    """`moecomm stage-agent` on one "host", `moecomm frontend --stages 2 --stage-hosts
    local,HOST:PORT` on another: what a user types, served through the OpenAI API, the same
    greedy tokens as the model in one process."""
    from moecomm_serving.engine.generate import generate
    from moecomm_serving.model.tokenizer import load_tokenizer
    from moecomm_serving.model.transformer import load_model
    from moecomm_serving.types import SamplingParams

    cli = [*PY, "-m", "moecomm_serving.cli"]
    _, key = token_file(tmp_path)
    with netns.Lab() as lab:
        fe, a = lab.add_host("fe"), lab.add_host("a")
        agent_argv = ["stage-agent", "--host", a.addr, "--port", str(AGENT_PORT)]
        a_log = tmp_path / "a.log"
        agent = start_logged(lab, a, [*cli, *agent_argv, "--token-file", str(key)], a_log)
        wait_ready(a_log, agent, time.monotonic() + START_S)
        fe_argv = [
            "frontend", "--checkpoint", str(tiny_dir), "--model-name", "tiny", "--local-experts",
            "--stages", "2", "--stage-hosts", f"local,{a.addr}:{AGENT_PORT}",
            "--stage-token-file", str(key), "--host", fe.addr, "--port", str(FRONTEND_PORT),
            "--threads", "1",
        ]  # fmt: skip
        front = start_logged(lab, fe, [*cli, *fe_argv], tmp_path / "fe.log")
        wait_ready(tmp_path / "fe.log", front, time.monotonic() + START_S)
        script, out = tmp_path / "ask.py", tmp_path / "answer.json"
        script.write_text(ASK)
        url = f"http://{fe.addr}:{FRONTEND_PORT}"
        rc, so, se = lab.run(
            fe, [*PY, str(script), url, CLI_PROMPT, str(CLI_NEW), str(out)], timeout=DRIVER_S
        )
        assert rc == 0, so + se + (tmp_path / "fe.log").read_text(errors="replace")[-3000:]
        log = (tmp_path / "fe.log").read_text(errors="replace")
    got = json.loads(out.read_text())
    assert got["status"] == 200, got
    model = load_model(tiny_dir, dtype=torch.float32)
    tok = load_tokenizer(tiny_dir, model.config)
    params = SamplingParams(max_new_tokens=CLI_NEW, ignore_eos=True)
    want = generate(model, [tok.encode(CLI_PROMPT)], params)[0].tokens
    assert got["body"]["choices"][0]["token_ids"] == want, log[-2000:]
