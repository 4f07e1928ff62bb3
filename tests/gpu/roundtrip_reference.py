"""The reference of the GPU round trip (test_device_roundtrip.py): what the device path computes
for y[t] = sum_k w[t,k] * expert_k(x[t]), rounded to bfloat16 where it rounds, with a bound of
one bfloat16 step at each rounding, and assertions that name the step, the token's experts and
the element that is off.

Where the GPU path rounds (bf16 activations, bf16 weights, bf16 answers), each after a float32
computation: the expert MLP's activation h = silu(x @ w1.T) * (x @ w3.T) (bf16 between the two
Triton kernels), each expert's score-weighted row s * (h @ w2.T) (the MLP's bf16 output), each
server's per-token sum of its rows (the bf16 response slot), and the client's sum over the
servers (the bf16 output). The same three-point rounding as tests/ops/test_triton_moe.py's
bf16_step_reference (where the float32-only reference was off by 0.074 on a token whose rows
nearly cancel), plus the response slot: which experts a server sums depends on the replica the
client picked, so the bound takes a second bf16 step of sum_k |row_k| for it instead of the
reference guessing the split.
"""

from __future__ import annotations

import torch

# bfloat16's spacing at 1.0 (2**-7): one unit in the last place of v is at most BF16_EPS * |v|.
BF16_EPS = torch.finfo(torch.bfloat16).eps
# fp8 (e4m3, per-128 block scales) through the same MLP: its quantization error is ~2**-4
# relative per element; over a row of 256 it averages to a few percent of the output's norm.
FP8_REL_TOL = 0.08


def bf16_reference(x, ids, w, experts) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference, bound), both [n, hidden] float32: the step rounded where the GPU path rounds,
    and one bfloat16 step of each rounded quantity that feeds each element."""
    xf = x.float().cpu()
    n, hidden = xf.shape
    y = torch.zeros(n, hidden)
    rows_mag = torch.zeros(n, hidden)
    h_mag = torch.zeros(n, hidden)
    ids, w = ids.cpu(), w.float().cpu()
    for e in sorted({int(v) for v in ids.flatten().tolist() if v >= 0}):
        t, k = (ids == e).nonzero(as_tuple=True)
        ew = experts[e]
        w1, w3, w2 = ew.w1.float(), ew.w3.float(), ew.w2.float()
        xe = xf[t]
        h = torch.nn.functional.silu(xe @ w1.t()) * (xe @ w3.t())
        h = h.to(torch.bfloat16).float()
        s = w[t, k].unsqueeze(1)
        row = (s * (h @ w2.t())).to(torch.bfloat16).float()
        y.index_add_(0, t, row)
        rows_mag.index_add_(0, t, row.abs())
        h_mag.index_add_(0, t, s.abs() * (h.abs() @ w2.abs().t()))
    ref = y.to(torch.bfloat16).float()
    # The output's rounding, each row's and each server's partial sum's (<= sum |row|), and one
    # step of every h element feeding the row.
    bound = BF16_EPS * (ref.abs() + 2 * rows_mag + h_mag)
    return ref, bound


def _token_text(t: int, ids, w) -> str:
    experts = [int(e) for e in ids[t].tolist()]
    weights = [round(float(v), 4) for v in w[t].tolist()]
    return f"token {t} (experts {experts}, weights {weights})"


def assert_matches(y, x, ids, w, experts, where: str) -> None:
    """y (the device path's answer, [n, hidden]) within the bound of bf16_reference; a failure
    names ``where`` (the step), the worst token with its experts, and the element."""
    ref, bound = bf16_reference(x, ids, w, experts)
    got = y.float().cpu()
    assert got.shape == ref.shape, f"{where}: answer of shape {tuple(got.shape)}, want {ref.shape}"
    bad_nan = ~torch.isfinite(got)
    if bad_nan.any():
        t, c = (int(v) for v in bad_nan.nonzero()[0])
        raise AssertionError(f"{where}: {_token_text(t, ids, w)}, element {c}: {got[t, c]}")
    diff = (got - ref).abs()
    over = diff > bound
    if over.any():
        ratio = diff / bound.clamp_min(1e-30)
        t, c = divmod(int(ratio.argmax()), ref.shape[1])
        raise AssertionError(
            f"{where}: {int(over.sum())} of {diff.numel()} elements off by more than their bound;"
            f" worst {_token_text(t, ids, w)}, element {c}: got {float(got[t, c]):.6g}, "
            f"reference {float(ref[t, c]):.6g}, off by {float(diff[t, c]):.3g} "
            f"({float(ratio[t, c]):.2f}x its bound {float(bound[t, c]):.3g})"
        )


def fp8_close(y, x, ids, w, experts, where: str) -> None:
    """The fp8 path's answer within FP8_REL_TOL of the bf16 reference (relative, over the
    output); a failure names ``where``, the token whose answer is worst, and its worst element."""
    ref, _ = bf16_reference(x, ids, w, experts)
    got = y.float().cpu()
    assert got.shape == ref.shape, f"{where}: answer of shape {tuple(got.shape)}, want {ref.shape}"
    rel = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
    if not rel < FP8_REL_TOL:  # also false for NaN
        per_token = (got - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-30)
        t = int(torch.nan_to_num(per_token, nan=float("inf")).argmax())
        c = int(torch.nan_to_num((got[t] - ref[t]).abs(), nan=float("inf")).argmax())
        raise AssertionError(
            f"{where}: fp8 round trip differs by {rel:.3f} relative (tolerance {FP8_REL_TOL}); "
            f"worst {_token_text(t, ids, w)}: {float(per_token[t]):.3f} relative, element {c}: "
            f"got {float(got[t, c]):.6g}, reference {float(ref[t, c]):.6g}"
        )
