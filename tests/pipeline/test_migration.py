"""The generic stage runtime with a model-free compute (moecomm.pipeline.testing): exact outputs
through redistributions, and the migration is asynchronous — the destination computes its other
layers while the source is still working, and waits only at the migrated layer."""

from __future__ import annotations

import functools

import pytest
from moecomm.pipeline.driver import Pipeline, run_decode
from moecomm.pipeline.testing import expected_token, make_fake_stage, read_log
from moecomm.wire.protocol import SlotLayout

LAYERS, STAGES = 4, 2
LAYOUT = SlotLayout(max_tokens=64, hidden=8, topk=1, encoding="f32", out_encoding="f32")
PROMPTS = [[3, 9, 4], [17], [5, 5], [40, 41, 42, 43]]
NEW = 8
# The source (stage 1) is held back this long in the layer it gives away, in the last step
# under the old map: long against a fake step (~1 ms), short for the test.
HOLD_S = 0.4


def expected_tokens() -> list[list[int]]:
    out = []
    for p in PROMPTS:
        toks, last = [], p[-1]
        for _ in range(NEW):
            last = expected_token(last, LAYERS)
            toks.append(last)
        out.append(toks)
    return out


@pytest.mark.timeout(90)
def test_async_kv_migration_overlaps_the_destination(tmp_path):
    # Submission 4 switches to k = 1 from step 5 on: layer 2 moves from stage 1 to stage 0,
    # exported by stage 1 during step 4 (held back by HOLD_S before that layer).
    slow = {(2, 4): HOLD_S}
    factory = functools.partial(make_fake_stage, str(tmp_path), slow)
    with Pipeline(factory, LAYERS, STAGES, LAYOUT, k_max=1, num_slots=2) as pipe:
        run = run_decode(pipe, PROMPTS, NEW, forced={4: 1, 9: 0, 12: 1})
    assert run.tokens == expected_tokens()
    assert run.remaps[0] == (5, 1)
    src, dst = read_log(str(tmp_path), 1), read_log(str(tmp_path), 0)
    export = next(e for e in src if e["event"] == "export" and e["step"] == 4)
    assert export["layer"] == 2
    # Sent as soon as layer 2 finished, before the source's next layer of the same step.
    src_layer3 = next(
        e for e in src if e["event"] == "layer" and e["layer"] == 3 and e["step"] == 4
    )
    assert export["t"] <= src_layer3["t"]
    # The destination ran its own layers of step 5 while the source was still held back ...
    dst_l0 = next(e for e in dst if e["event"] == "layer" and e["layer"] == 0 and e["step"] == 5)
    dst_l1 = next(e for e in dst if e["event"] == "layer" and e["layer"] == 1 and e["step"] == 5)
    assert dst_l0["t"] < dst_l1["t"] < export["t"]
    # ... and computed the migrated layer only after its cache arrived.
    imp = next(e for e in dst if e["event"] == "import" and e["layer"] == 2)
    dst_l2 = next(e for e in dst if e["event"] == "layer" and e["layer"] == 2 and e["step"] == 5)
    assert export["t"] <= imp["t"] <= dst_l2["t"]
    # Later switches moved the layer back and forth, each through one export/import.
    assert [e["layer"] for e in src if e["event"] == "export"] == [2, 2]
    assert [e["layer"] for e in dst if e["event"] == "export"] == [2]


@pytest.mark.timeout(90)
def test_missing_kv_cache_is_an_error_not_wrong_output(tmp_path):
    """A stage that would compute a layer without its cache raises, and the driver says so."""
    factory = functools.partial(make_fake_stage, str(tmp_path), None)
    from moecomm.pipeline.driver import PipelineError

    with Pipeline(factory, LAYERS, STAGES, LAYOUT, k_max=1) as pipe:
        pipe.submit([0], [0], [2], [1, 2])
        pipe.result()
        pipe.submit([0], [1], [1], [3])  # claims 1 cached token; the stages hold 2
        with pytest.raises(PipelineError, match=r"stage 0 failed: .*holds 2 positions"):
            pipe.result()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("gap", [1, 2])
def test_random_remaps_stay_exact(tmp_path, gap):
    """Pressure in miniature: 3 stages, 9 layers, a seeded random k every `gap` submissions
    (gap 1: a new map while the previous migration may still be in flight). The fake compute
    raises on any cache that is missing, stale or duplicated; outputs must be exact."""
    import random

    layers, stages, new = 9, 3, 20
    rng = random.Random(1000 + gap)
    forced = {i: rng.randint(0, 2) for i in range(1, 3 * new, gap)}
    factory = functools.partial(make_fake_stage, None, None)
    with Pipeline(factory, layers, stages, LAYOUT, k_max=2, num_slots=3) as pipe:
        run = run_decode(pipe, PROMPTS, new, forced=forced)
    want = []
    for p in PROMPTS:
        toks, last = [], p[-1]
        for _ in range(new):
            last = expected_token(last, layers)
            toks.append(last)
        want.append(toks)
    assert run.tokens == want
    assert len(run.remaps) >= 5 and set(run.step_ks) == {0, 1, 2}
