"""The plan of tools/gpu_check.py: the stage budgets of the two device calls that fit a lent GPU
machine's device time, the checks that they still fit, what `make gpu-check-plan` prints, and
which stages a run selects (CALL=, STAGE=, or neither). Standard library only: it runs before
anything is installed. The stages themselves are in gpu_check_stages.py."""

from __future__ import annotations

from gpu_check_run import CALL_RESERVE_S, KILL_GRACE_S, MIN_RUN_S, STAGE_OVERHEAD_S

# ---------------------------------------------------------------------------------------------
# The plan: two calls of the device tool. Budgets in seconds; each call's stages, with
# STAGE_OVERHEAD_S per stage and CALL_RESERVE_S per call, must fit its limit, and the two calls
# together the device time a check may use (tests/test_gpu_check.py fails when they do not).

CALL_LIMITS_S = {1: 360.0, 2: 240.0}
# 10 of a task's 15 minutes of device time: the rest goes to the machine's start, the
# transfers and the idle waits.
DEVICE_TIME_S = 600.0
# The device tool's limit for one command.
COMMAND_LIMIT_S = 600.0
PLAN = {
    1: {"preflight": 20.0, "build": 195.0, "smoke": 45.0, "core": 85.0},
    # The build is call 1's, reused (its stamp, the import check): seconds on a warm machine.
    # The preflight's probe took 5.7 s on an H200; a command starts only with MIN_RUN_S +
    # KILL_GRACE_S of its stage left, so no budget may be below STAGE_FLOOR_S.
    2: {"preflight": 15.0, "build": 15.0, "deepep": 105.0, "bench": 45.0, "sanitizer": 40.0},
}
# What a build from scratch gets, also in call 2 when the machine was not warm any more.
BUILD_FULL_S = PLAN[1]["build"]
STAGE_ORDER = (
    "preflight",
    "build",
    "smoke",
    "core",
    "deepep",
    "bench",
    "sanitizer",
    "racecheck",
    "host",
)
# The plain run (`make gpu-check`, no CALL or STAGE): everything but the optional racecheck.
PLAIN_STAGES = tuple(s for s in STAGE_ORDER if s != "racecheck")
# Budgets outside a call (the plain run; STAGE= without CALL=).
DEFAULT_BUDGETS = {
    **PLAN[1],
    **{k: v for k, v in PLAN[2].items() if k not in ("preflight", "build")},
    "host": 35.0,
    "racecheck": 120.0,
}
# Without a device no device time is spent: `make build` may rebuild on a small machine.
NO_DEVICE_BUDGETS = {"preflight": 60.0, "build": 420.0, "host": 90.0}
NO_DEVICE_LIMIT_S = 590.0
# The least budget a stage can run a command in (10 s: the call-2 preflight of 2026-11-28 had
# exactly that and never started its probe), with a few seconds for the command itself.
STAGE_FLOOR_S = MIN_RUN_S + KILL_GRACE_S + 3.0


def stage_total(budgets: dict) -> float:
    """What a list of stage budgets costs with the per-stage overhead and the call's reserve."""
    return sum(budgets.values()) + STAGE_OVERHEAD_S * len(budgets) + CALL_RESERVE_S


def plain_budgets() -> dict:
    return {name: DEFAULT_BUDGETS[name] for name in PLAIN_STAGES}


def plan_problems() -> list[str]:
    """Every way the plan does not fit; empty when it does."""
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
    both = sum(stage_total(b) for b in PLAN.values())
    if both > DEVICE_TIME_S:
        problems.append(f"the two calls: {both:.0f} s > {DEVICE_TIME_S:.0f} s of device time")
    plain = stage_total(plain_budgets())
    if plain > COMMAND_LIMIT_S:
        problems.append(f"the plain run: {plain:.0f} s > {COMMAND_LIMIT_S:.0f} s per command")
    return problems


def plan_text() -> str:
    lines = ["gpu-check plan: stage budgets (s) per device call (docs/gpu-check.md)", ""]
    for call, budgets in PLAN.items():
        limit = CALL_LIMITS_S[call]
        lines.append(
            f"call {call}: make gpu-check CALL={call} OUT=$OUT/gpu PACK=1  (limit {limit:.0f})"
        )
        for name, budget in budgets.items():
            note = ""
            if call > 1 and name == "build":
                note = f"  reused on a warm machine; {BUILD_FULL_S:.0f} when it was not warm"
            lines.append(f"  {name:<12}{budget:6.0f}{note}")
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
        "time; the rest: the machine's start, transfers, idle)"
    )
    plain = stage_total(plain_budgets())
    verdict = "fits" if plain <= COMMAND_LIMIT_S else "DOES NOT FIT"
    lines.append(
        f"plain run     {plain:6.0f}  {verdict} (<= {COMMAND_LIMIT_S:.0f} per command): "
        + ", ".join(f"{k} {v:.0f}" for k, v in plain_budgets().items())
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
        names = list(PLAIN_STAGES)
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
