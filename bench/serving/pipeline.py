"""DynaPipe: predictor accuracy on this machine, and a decode-heavy pipeline with a uniform layer
split against bubble-aware redistribution.

    python bench/serving/pipeline.py [--json PATH] [--stages 2 3] [--quick] [--predictor-only]

Part 1 (predictor): one layer (and the sampling step: final norm, LM head, a temperature /
top-p draw per sequence) of the tiny reference model is timed in-process over random chunks:
mixed (85% decode requests, 15% prefill chunks of 8-64 tokens) and pure decode, random context
lengths. Every chunk is timed in PASSES passes spread apart in time; a pass gives its *cold* time
(the first call on freshly built tensors, a new shape right after other work) and its *warm* time
(the minimum of REPEATS further calls). Models are fitted on the even chunks (values: median over
all passes) and evaluated on the odd ones, held out: median over chunks of |pred − measured| /
measured, measured = median of 3 passes; the noise floor next to it is the same error when the
median of the 3 other passes is the prediction (the best any model can do), and the spread is
MAD / median over the passes. Three layer models: DynaPipe's formula, + a per-chunk constant
(both fitted per regime), and the machine model (+ Σ L context term + cold terms, one fit over
warm and cold samples); sampling: α·N + β.

Part 2 (end to end): the same sampled decode workload (every prompt decoded to the same length,
micro-batches = stages) through S stage processes, three ways, alternating rounds so both see the
same background load: `uniform` (k = 0, fixed), `dynapipe` (predictor fitted from the stages' own
profiles, scheduler with its default 25-step window, live KV migration) and `best_static` (the k
that DynaPipe settles on, fixed from the start: the bound a perfect oracle reaches). The model
has a large vocabulary so sampling is a real share of a step, as in production models. Reported:
median wall time of the whole workload and per decode step (TPOT), ratio = contender / uniform
(< 1: faster), and whether every run produced the same tokens (`same_tokens`: sampling is
seeded per sequence, so any difference would be a pipeline error).
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _lib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this group's scripts

from _lib.common import format_table, percentile, time_calls, write_json
from moecomm.pipeline.driver import Pipeline, run_decode
from moecomm.pipeline.predictor import (
    MACHINE_LAYER_TERMS,
    FitReport,
    LatencyPredictor,
    LayerSample,
    LayerTimeModel,
    SampleSample,
    SampleTimeModel,
)
from moecomm.pipeline.scheduler import BubbleScheduler, max_moves
from moecomm.pipeline.testing import EmulatedCost, make_fake_stage
from moecomm.wire.protocol import SlotLayout
from moecomm_serving.engine.generate import sample_next
from moecomm_serving.engine.stages import model_pipeline
from moecomm_serving.kv.cache import ForwardBatch
from moecomm_serving.model.tiny import write_tiny
from moecomm_serving.model.transformer import load_model
from moecomm_serving.types import SamplingParams

SEED = 0
# 8 layers so two stages can trade up to three; a 16k vocabulary makes the LM head cost about
# as much as a few layers, the regime where the last stage is the bottleneck.
LAYERS, VOCAB = 8, 16384
# Every chunk is timed in PASSES passes over all chunks, spread apart in time (the machine is
# shared: 2 cores, other tenants' test runs, so contention comes in bursts of seconds): an even
# count, half of them the measurement and half the noise-floor oracle (held_out). A pass's warm
# time is the minimum of REPEATS calls (the uncontended cost); sampling has WARMUP calls first.
PASSES, REPEATS, WARMUP = 6, 3, 1
# Sampling as production serving does it (temperature, top-p, a seeded draw per sequence): its
# cost per sequence (a sort over the vocabulary) is what makes the last stage the slow one.
SAMPLING = SamplingParams(max_new_tokens=1, temperature=0.8, top_p=0.95, seed=SEED)
# Sequences per sampling call profiled in part 1 (a micro-batch's decode sequences).
MAX_DECODE = 32
# Predictor chunks: number of chunks timed, requests per chunk, context range (tokens).
CHUNKS, MAX_REQS, MAX_CONTEXT = 160, 24, 1024
# Emulated device compute: the fake stage's hidden width, and its token ids' range (ids grow by
# the layer count each step and must stay exact in float32).
EMULATED_LAYOUT = SlotLayout(max_tokens=1024, hidden=8, topk=1, encoding="f32", out_encoding="f32")
EMULATED_TOKENS = 1000
# End-to-end workload: decode-heavy (short prompts, long outputs).
E2E_SEQS, E2E_PROMPT, E2E_NEW, E2E_ROUNDS = 16, 8, 96, 3


# Predictor error targets of the issue (median relative error on held-out chunks).
LAYER_TARGET = 0.05
SAMPLE_TARGET = 0.01


def _row(quantity, chunks, h: dict, dynapipe: float, chunk: float | None, target) -> dict:
    return {
        "quantity": quantity,
        "chunks": f"{chunks} ({h['items']})",
        "dynapipe": dynapipe * 100,
        "chunk": None if chunk is None else chunk * 100,
        "new": h["model"] * 100,
        "new_p90": h["model_p90"] * 100,
        "floor": h["floor"] * 100,
        "spread": h["spread"] * 100,
        "target": target * 100,
        "met": h["model"] <= target,
        "floor_met": h["floor"] <= target,
    }


def make_checkpoint(out: str) -> None:
    write_tiny(
        out, "mixtral", seed=SEED, overrides={"num_hidden_layers": LAYERS, "vocab_size": VOCAB}
    )


def random_chunk(rng: random.Random) -> tuple[list[int], list[int]]:
    """Mostly decode requests (n = 1), a prefill chunk now and then; random cached lengths."""
    reqs = rng.randint(1, MAX_REQS)
    nn = [1 if rng.random() < 0.85 else rng.randint(8, 64) for _ in range(reqs)]
    past = [rng.randint(0, MAX_CONTEXT) for _ in range(reqs)]
    return nn, past


def time_layer(model, layer: int, nn: list[int], past: list[int]) -> tuple[float, float]:
    """``(cold, warm)`` seconds of one layer over a chunk: the first call on freshly built
    tensors (a new shape, right after other work: what a stage sees on a new step), then the
    minimum of REPEATS further calls (the uncontended cost of the same shape)."""
    c = model.config
    caches = []
    for p in past:
        seq = model.new_sequence()
        if p:
            kv = seq.layer(layer)
            kv.append(
                torch.randn(c.num_key_value_heads, p, c.head_dim),
                torch.randn(c.num_key_value_heads, p, c.head_dim),
            )
        caches.append(seq)
    starts, pos, t = [], [], 0
    for p, n in zip(past, nn, strict=True):
        starts.append(t)
        pos.append(torch.arange(p, p + n))
        t += n
    batch = ForwardBatch(caches, nn, past, starts, torch.cat(pos))
    h = torch.randn(t, c.hidden_size)
    block = model.block(layer)

    def call():
        block.forward(h, batch, model.rope, model.experts)
        for cache, p in zip(caches, past, strict=True):
            cache.layer(layer).truncate(p)

    cold, *warm = time_calls(call, 1 + REPEATS, 0)
    return cold / 1e9, min(warm) / 1e9


def time_sample(model, n: int) -> float:
    """ModelStage.sample's work: final norm + LM head, then one seeded draw per sequence."""
    h = torch.randn(n, model.config.hidden_size)
    gens = [torch.Generator().manual_seed(SEED + i) for i in range(n)]

    def call():
        logits = model.logits(h)
        return [sample_next(logits[i], SAMPLING, gens[i]) for i in range(n)]

    return min(time_calls(call, REPEATS, WARMUP)) / 1e9


def held_out(pred: list[float], passes: list[list[float]]) -> dict:
    """Errors on held-out items, each with its measurements over PASSES passes.

    measured = median of the even passes; ``model`` = median over items of |pred − measured| /
    measured. ``floor`` = the same error for the median of the odd passes used as the prediction:
    the best any model can do against this measurement (pessimistic by up to √2, the oracle being
    as noisy as the measurement). ``spread`` = median over items of MAD / median of all passes."""
    meas = [statistics.median(m[0::2]) for m in passes]
    oracle = [statistics.median(m[1::2]) for m in passes]
    model = FitReport.of(pred, meas)

    def rel_mad(m: list[float]) -> float:
        mid = statistics.median(m)
        return statistics.median(abs(x - mid) for x in m) / mid

    return {
        "items": len(pred),
        "model": model.median_rel_error,
        "model_p90": model.p90_rel_error,
        "floor": FitReport.of(oracle, meas).median_rel_error,
        "spread": statistics.median(rel_mad(m) for m in passes),
    }


def _fitted(model, samples):
    for s in samples:
        model.add(s)
    model.fit()
    return model


def bench_predictor(path: str, chunks: int) -> dict:
    model = load_model(path, dtype=torch.float32)
    load_before = os.getloadavg()  # the machine is shared: say how busy it was
    rng = random.Random(SEED)
    layer = LAYERS // 2
    mixed = [random_chunk(rng) for _ in range(chunks)]
    # Pure decode chunks (every request n = 1): the regime of a decode-heavy load.
    decode = [
        ([1] * r, [rng.randint(0, MAX_CONTEXT) for _ in range(r)])
        for r in (rng.randint(1, MAX_REQS) for _ in range(chunks // 2))
    ]
    chunk_list = mixed + decode
    sizes = [n for n in range(1, MAX_DECODE + 1) for _ in range(2)]
    rng.shuffle(sizes)
    cold: list[list[float]] = [[] for _ in chunk_list]
    warm: list[list[float]] = [[] for _ in chunk_list]
    samp: list[list[float]] = [[] for _ in sizes]
    for _ in range(PASSES):  # passes spread in time: a burst of contention spoils one pass
        for j, (nn, past) in enumerate(chunk_list):
            c, w = time_layer(model, layer, nn, past)
            cold[j].append(c)
            warm[j].append(w)
        for j, n in enumerate(sizes):
            samp[j].append(time_sample(model, n))
    lengths = [tuple(p + n for p, n in zip(past, nn, strict=True)) for nn, past in chunk_list]

    def sample(j: int, regime: str) -> LayerSample:
        t = statistics.median((cold if regime == "cold" else warm)[j])
        return LayerSample(tuple(chunk_list[j][0]), lengths[j], t, regime == "cold")

    # Even chunks fit, odd chunks are held out (different random chunks, mixed and decode).
    fit_idx = range(0, len(chunk_list), 2)
    forms = {"dynapipe": {}, "chunk": {"chunk_term": True}}
    models = {
        (form, regime): _fitted(LayerTimeModel(**kw), [sample(j, regime) for j in fit_idx])
        for form, kw in forms.items()
        for regime in ("warm", "cold")
    }
    new = _fitted(
        LayerTimeModel(**MACHINE_LAYER_TERMS),
        [sample(j, r) for j in fit_idx for r in ("warm", "cold")],
    )
    rows = []
    subsets = {"mixed": range(1, chunks, 2), "decode": range(chunks + 1, len(chunk_list), 2)}
    for regime, passes in (("warm", warm), ("cold", cold)):
        for subset, idx in subsets.items():
            errs = {
                form: held_out(
                    [m.predict(chunk_list[j][0], lengths[j]) for j in idx],
                    [passes[j] for j in idx],
                )["model"]
                for (form, reg), m in models.items()
                if reg == regime
            }
            h = held_out(
                [new.predict(chunk_list[j][0], lengths[j], regime == "cold") for j in idx],
                [passes[j] for j in idx],
            )
            rows.append(
                _row(f"T_layer {regime}", subset, h, errs["dynapipe"], errs["chunk"], LAYER_TARGET)
            )
    samples = [SampleSample(n, statistics.median(m)) for n, m in zip(sizes, samp, strict=True)]
    lin = _fitted(SampleTimeModel(), samples[::2])
    h = held_out([lin.predict(n) for n in sizes[1::2]], samp[1::2])
    rows.append(_row("T_sample", "1-32 seqs", h, h["model"], None, SAMPLE_TARGET))
    pred = LatencyPredictor()
    pred.layer, pred.sample = new, lin
    nn, ll = [1] * 16, [512] * 16
    cost = percentile(time_calls(lambda: pred.predict(nn, ll, 16), 2000, 100), 50) / 1e3
    coefs = ("phi1", "phi2", "eps", "chunk", "lam", "cold_chunk", "cold_req")
    chunk_warm = models[("chunk", "warm")]
    return {
        "repeats": {"passes": PASSES, "measured": "median of passes 0,2,4", "calls": REPEATS},
        "layer_new": {k: getattr(new, k) for k in coefs},
        "layer_chunk": {k: getattr(chunk_warm, k) for k in coefs[:4]},
        "layer_dynapipe": {k: getattr(models[("dynapipe", "warm")], k) for k in coefs[:3]},
        "sample": {"alpha": lin.alpha, "beta": lin.beta},
        "rows": rows,
        "predict_us": cost,
        "load_average": {"before": load_before, "after": os.getloadavg()},
    }


def model_pipe(path: str, stages: int, initial_k: int):
    return model_pipeline(path, stages, initial_k=initial_k, max_tokens=1024, sampling=SAMPLING)


def emulated_pipe(cost: EmulatedCost, stages: int, initial_k: int):
    factory = functools.partial(make_fake_stage, None, None, cost=cost)
    k_max = max_moves(LAYERS, stages)
    return Pipeline(factory, LAYERS, stages, EMULATED_LAYOUT, k_max, initial_k, stages)


def e2e_once(make_pipe, stages: int, mode: str, k: int, prompts) -> dict:
    pred = sched = None
    initial = k if mode == "best_static" else 0
    if mode == "dynapipe":
        pred = LatencyPredictor(**MACHINE_LAYER_TERMS)
        sched = BubbleScheduler(LAYERS, stages)
    with make_pipe(stages, initial) as pipe:
        run = run_decode(pipe, prompts, E2E_NEW, scheduler=sched, predictor=pred)
    decode_steps = max(1, run.steps // stages - 1)
    return {
        "seconds": run.seconds,
        "tpot_ms": run.seconds / decode_steps * 1e3,
        "final_k": run.step_ks[-1],
        "remaps": run.remaps,
        "tokens": run.tokens,
    }


def bench_e2e(make_pipe, kind: str, stages: int, rounds: int, vocab: int) -> list[dict]:
    rng = random.Random(SEED + 1)
    prompts = [[rng.randrange(vocab) for _ in range(E2E_PROMPT)] for _ in range(E2E_SEQS)]
    results: dict[str, list[dict]] = {"uniform": [], "dynapipe": [], "best_static": []}
    for _ in range(rounds):
        results["uniform"].append(e2e_once(make_pipe, stages, "uniform", 0, prompts))
        results["dynapipe"].append(e2e_once(make_pipe, stages, "dynapipe", 0, prompts))
        k = results["dynapipe"][-1]["final_k"]
        results["best_static"].append(e2e_once(make_pipe, stages, "best_static", k, prompts))
    ref_tokens = results["uniform"][0]["tokens"]
    base = percentile([r["seconds"] for r in results["uniform"]], 50)
    rows = []
    for mode, runs in results.items():
        secs = percentile([r["seconds"] for r in runs], 50)
        rows.append(
            {
                "compute": kind,
                "stages": stages,
                "mode": mode,
                "k": "/".join(str(r["final_k"]) for r in runs),
                "remaps": sum(len(r["remaps"]) for r in runs) / len(runs),
                "seconds": secs,
                "tpot_ms": percentile([r["tpot_ms"] for r in runs], 50),
                "ratio": secs / base,
                "same_tokens": all(r["tokens"] == ref_tokens for r in runs),
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--stages", type=int, nargs="+", default=[2])
    p.add_argument("--quick", action="store_true", help="fewer chunks and rounds (smoke run)")
    p.add_argument("--predictor-only", action="store_true", help="part 1 only")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(tmp)
        pr = bench_predictor(tmp, CHUNKS // 4 if args.quick else CHUNKS)
        print(
            "predictor: held-out median relative error % of DynaPipe's formula, + per-chunk "
            "constant, the machine model (new); noise floor and spread of repeat measurements"
        )
        cols = [
            ("quantity", "quantity", "s"),
            ("chunks", "chunks (n)", "s"),
            ("dynapipe", "dynapipe_%", ".2f"),
            ("chunk", "+chunk_%", ".2f"),
            ("new", "new_%", ".2f"),
            ("new_p90", "new_p90_%", ".2f"),
            ("floor", "floor_%", ".2f"),
            ("spread", "spread_%", ".2f"),
            ("target", "target_%", ".1f"),
            ("met", "met", ""),
            ("floor_met", "floor_met", ""),
        ]
        rows = pr.pop("rows")  # written once, as predictor_table
        print(format_table(rows, cols))
        new, sa = pr["layer_new"], pr["sample"]
        print(
            f"new: phi1 {new['phi1']:.3e} s/token, phi2 {new['phi2']:.3e} s/(token*ctx), "
            f"eps {new['eps']:.3e} s/request, chunk {new['chunk']:.3e} s, "
            f"lam {new['lam']:.3e} s/ctx, cold {new['cold_chunk']:.3e} s + "
            f"{new['cold_req']:.3e} s/request; sampling alpha {sa['alpha']:.3e} s/seq, "
            f"beta {sa['beta']:.3e} s; "
            f"one prediction {pr['predict_us']:.2f} us; load average {os.getloadavg()}"
        )
        if args.predictor_only:
            write_json(args.json, {"predictor": pr, "predictor_table": rows})
            return
        rounds = 1 if args.quick else E2E_ROUNDS
        # The emulated device sleeps by the + chunk model, whose terms EmulatedCost has.
        lay, sam = pr["layer_chunk"], pr["sample"]
        cost = EmulatedCost(
            lay["phi1"], lay["phi2"], lay["eps"], lay["chunk"], sam["alpha"], sam["beta"]
        )
        e2e = []
        for st in args.stages:
            real = functools.partial(model_pipe, tmp)
            e2e += bench_e2e(real, "model", st, rounds, VOCAB)
            emu = functools.partial(emulated_pipe, cost)
            e2e += bench_e2e(emu, "emulated", st, rounds, EMULATED_TOKENS)
        print(f"\nend to end: {E2E_SEQS} sequences x {E2E_NEW} new tokens, prompts of {E2E_PROMPT}")
        cols = [
            ("compute", "compute", "s"),
            ("stages", "stages", "d"),
            ("mode", "mode", "s"),
            ("k", "final_k", "s"),
            ("remaps", "remaps", ".1f"),
            ("seconds", "seconds", ".3f"),
            ("tpot_ms", "tpot_ms", ".2f"),
            ("ratio", "ratio", ".3f"),
            ("same_tokens", "same_tokens", ""),
        ]
        print(format_table(e2e, cols))
        write_json(args.json, {"predictor": pr, "predictor_table": rows, "end_to_end": e2e})


if __name__ == "__main__":
    main()
