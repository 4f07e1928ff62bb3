"""The plan of tools/gpu_check.py: which stage each GPU test file runs in and with what cap, the
stage budgets of the two device calls that fit a lent GPU machine's device time, the checks
that they still fit, what `make gpu-check-plan` prints, and which stages a run selects (CALL=,
STAGE=, or neither). Standard library only: it runs before anything is installed. The stages
themselves are in gpu_check_stages.py.

A stage's budget is its share of its call: the runner (gpu_check_run) ends stage k at the
call's start plus the budgets of stages 1..k, so what a stage leaves unused flows to the next.
Inside a test stage each file has its own cap, and the stage's budget is the sum of its files'
caps, so every file it holds gets its cap even when the files before it use theirs in full."""

from __future__ import annotations

from gpu_check_run import CALL_RESERVE_S, KILL_GRACE_S, MIN_RUN_S, STAGE_OVERHEAD_S

# ---------------------------------------------------------------------------------------------
# The GPU test files, by stage, each with its cap in seconds (its pytest's start-up of 3-4 s
# included). Figures of 2026-11-28 (one H200, bench/results/gpu/2026-11-28/) where there are
# any. Order inside a stage is the order they run in.

SMOKE_TEST = "tests/gpu/test_smoke_loopback.py"
DEEPEP_TEST = "tests/compat/test_deep_ep_cuda.py"
ENGINES_TEST = "tests/engines/test_engines_gpu.py"
NIXL_TEST = "tests/wire/test_nixl_tensors.py"
STAGE_FILES: dict[str, dict[str, float]] = {
    # Never given a verdict on a GPU (or failed on code changed since): first, so the device
    # time goes to what is not known yet.
    "core": {
        # 12 s when it passes; ~50 s when it failed with a 30 s probe deadline (now seconds).
        "tests/gpu/test_ipc_gpu.py": 35.0,
        # 75-130 s with 11 sequential server starts; the servers now start once per module.
        "tests/gpu/test_device_roundtrip.py": 60.0,
        # One Triton MLP test (bf16, its reference fixed after the run): compile + a few runs.
        "tests/ops/test_triton_moe.py": 20.0,
        # ~30-45 s: several Triton fp8 grouped-GEMM compilations.
        "tests/ops/test_triton_grouped_fp8.py": 40.0,
        # ~15 s: one PE, plus the two-PE test's machine skip on one GPU without MPS.
        "tests/gpu/test_nvshmem_gpu.py": 20.0,
    },
    # CUDA_LAUNCH_BLOCKING=1; 4 passed in 7.3 s after the fixes (triage-after-fix/02.txt).
    "smoke": {SMOKE_TEST: 20.0},
    # Passed on 2026-11-28 on code unchanged since: rerun last, for regressions.
    "regress": {
        "tests/ops/test_device_dispatch.py": 30.0,  # 22.8 s in call 1
        "tests/ops/test_reorg.py": 15.0,  # 11.1 s
        "tests/serving/model/test_model.py": 15.0,  # 1.8 s + start-up (torch, the model)
    },
    # One pytest over the scenario file; its scenarios' own caps add up inside it
    # (tests/compat/deep_ep_cuda_procs.py: SETUP_TIMEOUT_S + SCENARIO_TIMEOUT_S + the margin).
    "deepep": {DEEPEP_TEST: 110.0},
}
# Files that run only where the machine has what they need and no build can provide: left out
# (a machine skip, named in the summary) otherwise; when present they run in their stage after
# its planned files, in the time the stage has left, with this cap. Not counted in the call's
# budget: on the lent GPU machine neither is there (the engine environment is ~1 GB, NIXL's
# wheel 65 MiB, and the device tool carries 64 MiB).
CONDITIONAL_FILES: dict[str, tuple[str, float, str]] = {
    ENGINES_TEST: ("core", 60.0, "the engine environment (tools/engines_env.sh, ~1 GB)"),
    NIXL_TEST: ("core", 20.0, "the nixl module (its wheel: 65 MiB)"),
}
# A gpu-marked file in no stage (a new one) still runs, last in core, with this cap; the plan
# check fails until it is given a stage (tests/tools/test_gpu_check.py).
UNPLANNED_CAP_S = 30.0
# The join/leave diagnostic (tools/probe/join_leave_diag.py): four variants of one join.
JOINLEAVE_S = 60.0

# ---------------------------------------------------------------------------------------------
# The calls. Each call's stages, with STAGE_OVERHEAD_S per stage and CALL_RESERVE_S per call,
# must fit its limit, and the two calls together the device time a check may use.

CALL_LIMITS_S = {1: 420.0, 2: 240.0}
# 11 of a task's 15 minutes of device time: the rest goes to the machine's start (a minute or
# more), the transfers and the gap between the two calls.
DEVICE_TIME_S = 660.0
# The device tool's limit for one command.
COMMAND_LIMIT_S = 600.0


def files_budget(stage: str) -> float:
    return sum(STAGE_FILES[stage].values())


PLAN = {
    1: {
        # The probe took 5.7 s on an H200; now also compute-sanitizer opening the device.
        "preflight": 20.0,
        # A build from scratch took 43 s on 2026-11-28 (venv 12 s, pip install -e . 31 s).
        "build": 65.0,
        "joinleave": JOINLEAVE_S,
        "core": files_budget("core"),
        "smoke": files_budget("smoke"),
        "regress": files_budget("regress"),
    },
    # The build is call 1's, reused (its stamp, the import check): seconds on a warm machine.
    2: {
        "preflight": 20.0,
        "build": 15.0,
        "deepep": files_budget("deepep"),
        # One GPU expert server's start (~5 s), a one-layer checkpoint, 128-token timings.
        "bench": 40.0,
        "sanitizer": 40.0,
    },
}
# What a build from scratch gets, also in call 2 when the machine was not warm any more.
BUILD_FULL_S = PLAN[1]["build"]
STAGE_ORDER = (
    "preflight",
    "build",
    "joinleave",
    "core",
    "smoke",
    "regress",
    "deepep",
    "bench",
    "sanitizer",
    "racecheck",
    "host",
)
# The plain run (`make gpu-check`, no CALL or STAGE): everything but the optional racecheck;
# with a device also without host (it needs none: run it on the machine without one) and the
# join/leave diagnostic (call 1's, or STAGE=joinleave), so that it fits one command.
PLAIN_STAGES = tuple(s for s in STAGE_ORDER if s != "racecheck")
PLAIN_DEVICE_STAGES = tuple(s for s in PLAIN_STAGES if s not in ("host", "joinleave"))
# Budgets outside a call (the plain run; STAGE= without CALL=).
DEFAULT_BUDGETS = {
    **PLAN[1],
    **{k: v for k, v in PLAN[2].items() if k not in ("preflight", "build")},
    "host": 35.0,
    "racecheck": 120.0,
}
# Without a device no device time is spent: `make build` may rebuild on a small machine, and the
# host stage compiles the CUDA check programs (~90 s on 2 loaded cores).
NO_DEVICE_BUDGETS = {"preflight": 60.0, "build": 420.0, "host": 300.0}
NO_DEVICE_LIMIT_S = 900.0
# The least budget a stage can run a command in (10 s: the call-2 preflight of 2026-11-28 had
# exactly that and never started its probe), with a few seconds for the command itself.
STAGE_FLOOR_S = MIN_RUN_S + KILL_GRACE_S + 3.0


def stage_total(budgets: dict) -> float:
    """What a list of stage budgets costs with the per-stage overhead and the call's reserve."""
    return sum(budgets.values()) + STAGE_OVERHEAD_S * len(budgets) + CALL_RESERVE_S


def plain_budgets(device: bool = True) -> dict:
    names = PLAIN_DEVICE_STAGES if device else PLAIN_STAGES
    return {name: DEFAULT_BUDGETS[name] for name in names}


def stage_of(path: str) -> str | None:
    """The stage a test file is planned in (conditional files included), or None."""
    for stage, files in STAGE_FILES.items():
        if path in files:
            return stage
    return CONDITIONAL_FILES[path][0] if path in CONDITIONAL_FILES else None


def call_of(stage: str) -> int | None:
    return next((c for c, budgets in PLAN.items() if stage in budgets), None)


def unplanned(discovered: list[str]) -> list[str]:
    """The gpu-marked files (gpu_check_files.discover_gpu_files) that are in no stage."""
    return [f for f in discovered if stage_of(f) is None]


def plan_problems(discovered: list[str] | None = None) -> list[str]:
    """Every way the plan does not fit; empty when it does. With ``discovered`` (the gpu-marked
    test files), also every one that is in no stage, and every planned file that is gone."""
    problems = []
    for call, budgets in PLAN.items():
        total = stage_total(budgets)
        if total > CALL_LIMITS_S[call]:
            problems.append(f"call {call}: {total:.0f} s > its {CALL_LIMITS_S[call]:.0f} s")
        short = [n for n, b in budgets.items() if b < STAGE_FLOOR_S]
        if short:
            problems.append(
                f"call {call}: {', '.join(short)} below {STAGE_FLOOR_S:.0f} s (a command starts "
                f"only with {MIN_RUN_S + KILL_GRACE_S:.0f} s of its stage left)"
            )
        unknown = set(budgets) - set(STAGE_ORDER)
        if unknown:
            problems.append(f"call {call}: unknown stages {sorted(unknown)}")
    for stage, files in STAGE_FILES.items():
        if call_of(stage) is None:
            problems.append(f"stage {stage} (files {', '.join(files)}) is in no call")
        elif sum(files.values()) > PLAN[call_of(stage)][stage]:
            problems.append(
                f"stage {stage}: its files' caps ({sum(files.values()):.0f} s) exceed its "
                f"budget ({PLAN[call_of(stage)][stage]:.0f} s)"
            )
        short = [f for f, cap in files.items() if cap < STAGE_FLOOR_S]
        if short:
            problems.append(f"stage {stage}: caps below {STAGE_FLOOR_S:.0f} s: {short}")
    for path, (stage, cap, _) in CONDITIONAL_FILES.items():
        if call_of(stage) is None or cap > PLAN[call_of(stage)][stage]:
            problems.append(f"{path}: cap {cap:.0f} s does not fit stage {stage}")
    both = sum(stage_total(b) for b in PLAN.values())
    if both > DEVICE_TIME_S:
        problems.append(f"the two calls: {both:.0f} s > {DEVICE_TIME_S:.0f} s of device time")
    plain = stage_total(plain_budgets())
    if plain > COMMAND_LIMIT_S:
        problems.append(f"the plain run: {plain:.0f} s > {COMMAND_LIMIT_S:.0f} s per command")
    if discovered is not None:
        for f in unplanned(discovered):
            problems.append(f"{f}: a gpu test file in no stage (gpu_check_plan.STAGE_FILES)")
        planned = [*(f for files in STAGE_FILES.values() for f in files), *CONDITIONAL_FILES]
        for f in planned:
            if f not in discovered:
                problems.append(f"{f}: planned, but no gpu-marked test file has that path")
    return problems


def plan_text(discovered: list[str] | None = None) -> str:
    lines = [
        "gpu-check plan: stage budgets (s) per device call, every GPU test file with its stage "
        "and cap (docs/gpu-check.md)",
        "a stage's budget is its share of the call: what a stage leaves unused flows to the next",
        "",
    ]
    for call, budgets in PLAN.items():
        limit = CALL_LIMITS_S[call]
        lines.append(
            f"call {call}: make gpu-check CALL={call} OUT=$OUT/gpu PACK=1  (limit {limit:.0f})"
        )
        for name, budget in budgets.items():
            note = ""
            if call > 1 and name == "build":
                note = f"  reused on a warm machine; {BUILD_FULL_S:.0f} when it was not warm"
            if name == "joinleave":
                note = "  tools/probe/join_leave_diag.py: cold/warm/no-spin/EAGER peer joins"
            lines.append(f"  {name:<12}{budget:6.0f}{note}")
            for path, cap in STAGE_FILES.get(name, {}).items():
                lines.append(f"    {path:<44}cap {cap:4.0f}")
            for path, (stage, cap, needs) in CONDITIONAL_FILES.items():
                if stage == name:
                    lines.append(
                        f"    {path:<44}cap {cap:4.0f}  only with {needs}; else a machine skip"
                        " (not counted)"
                    )
            if name == "core" and discovered is not None:
                for path in unplanned(discovered):
                    cap = UNPLANNED_CAP_S
                    lines.append(f"    {path:<44}cap {cap:4.0f}  UNPLANNED: in no stage")
        lines.append(f"  {'overhead':<12}{STAGE_OVERHEAD_S * len(budgets):6.0f}  per stage")
        lines.append(f"  {'reserve':<12}{CALL_RESERVE_S:6.0f}")
        total = stage_total(budgets)
        verdict = "fits" if total <= limit else "DOES NOT FIT"
        lines.append(f"  {'total':<12}{total:6.0f}  {verdict} (<= {limit:.0f})")
        lines.append("")
    both = sum(stage_total(b) for b in PLAN.values())
    verdict = "fits" if both <= DEVICE_TIME_S else "DOES NOT FIT"
    lines.append(
        f"both calls    {both:6.0f}  {verdict} (<= {DEVICE_TIME_S:.0f} of the 15 min of device "
        "time; the rest: the machine's start, transfers, the gap between the calls)"
    )
    plain = stage_total(plain_budgets())
    verdict = "fits" if plain <= COMMAND_LIMIT_S else "DOES NOT FIT"
    lines.append(
        f"plain run     {plain:6.0f}  {verdict} (<= {COMMAND_LIMIT_S:.0f} per command, with a "
        "device): " + ", ".join(f"{k} {v:.0f}" for k, v in plain_budgets().items())
    )
    lines.append(
        f"in no call: host {DEFAULT_BUDGETS['host']:.0f} (needs no device: run it here), "
        f"racecheck {DEFAULT_BUDGETS['racecheck']:.0f} (optional: STAGE=racecheck)"
    )
    return "\n".join(lines)


def select(
    call: int | None, only: list[str] | None, device: bool, stages: dict
) -> tuple[list[tuple[str, float]], float, str]:
    """(stage names with their budgets, the run's time limit, a label). ``stages`` are the
    stages by name (gpu_check_stages.all_stages()); --only pulls in the stages the chosen ones
    need (the build, the preflight) where they would run."""
    if call is not None:
        names = list(PLAN[call])
        budgets = {**DEFAULT_BUDGETS, **PLAN[call]}
        label = f"call {call}"
    else:
        names = list(PLAIN_DEVICE_STAGES if device else PLAIN_STAGES)
        budgets = dict(DEFAULT_BUDGETS)
        label = "all stages"
    if only:
        unknown = [s for s in only if s not in stages]
        if unknown:
            raise ValueError(f"unknown stage {', '.join(unknown)}: one of {', '.join(STAGE_ORDER)}")
        wanted = set(only)
        todo = list(only)
        while todo:
            stage = stages[todo.pop()]
            if stage.needs_device and not device:
                continue  # skipped here: what it needs need not run
            for need in stage.needs(device):
                if need not in wanted:
                    wanted.add(need)
                    todo.append(need)
        names = [s for s in STAGE_ORDER if s in wanted]
        label = f"{label}, stages {','.join(only)}" if call else f"stages {','.join(only)}"
    if not device:
        budgets.update(NO_DEVICE_BUDGETS)
        limit = NO_DEVICE_LIMIT_S
    elif call is not None:
        limit = CALL_LIMITS_S[call]
    else:
        limit = min(COMMAND_LIMIT_S, stage_total({n: budgets[n] for n in names}))
    return [(n, budgets[n]) for n in names], limit, label
