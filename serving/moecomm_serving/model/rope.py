"""Rotary position embeddings: the config as either transformers generation writes it, and the
inverse frequencies of each implemented rope type.

transformers 5 writes ``rope_parameters: {"rope_type", "rope_theta", ...}``; 4.x wrote a
top-level ``rope_theta`` and an optional ``rope_scaling: {"type" | "rope_type", "factor", ...}``.
Both are read into one :class:`RopeConfig`. Implemented types (the math of transformers'
``modeling_rope_utils``):

- ``default``: ``inv_freq[i] = theta ** (-2i / D)``;
- ``linear``: positions divided by ``factor``, i.e. ``inv_freq / factor``;
- ``yarn``: per-frequency blend of the interpolated (``inv_freq / factor``) and extrapolated
  frequencies over a linear ramp between the dimensions that turn ``beta_fast`` and
  ``beta_slow`` times over ``original_max_position_embeddings``; cos/sin are scaled by the
  attention factor (``0.1 ln(factor) + 1``, or the ``mscale`` / ``mscale_all_dim`` ratio).

Any other type, and any key of the rope dict this module does not know, is refused by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moecomm.errors import MoecommError

if TYPE_CHECKING:
    import torch

DEFAULT = "default"
LINEAR = "linear"
YARN = "yarn"
ROPE_TYPES = (DEFAULT, LINEAR, YARN)
# The YaRN paper's ramp bounds (rotations), transformers' defaults when the config has none.
YARN_BETA_FAST = 32.0
YARN_BETA_SLOW = 1.0
# Keys of the rope dict each type understands (the others change the math: refused).
_COMMON_KEYS = {"rope_type", "type", "rope_theta"}
_KEYS = {
    DEFAULT: _COMMON_KEYS,
    LINEAR: _COMMON_KEYS | {"factor"},
    YARN: _COMMON_KEYS
    | {
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "attention_factor",
        "mscale",
        "mscale_all_dim",
        "truncate",
    },
}


class UnsupportedRopeError(MoecommError, ValueError):
    """The config asks for a rope type or parameter that is not implemented."""


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str = DEFAULT
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = YARN_BETA_FAST
    beta_slow: float = YARN_BETA_SLOW
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


def read_rope(d: dict[str, Any], default_theta: float, max_positions: int) -> RopeConfig:
    """The rope of a HF config dict, in either layout; `default_theta` is the family's."""
    params = d.get("rope_parameters")
    if params is None:
        params = dict(d.get("rope_scaling") or {})
        params.setdefault("rope_theta", d.get("rope_theta", default_theta))
    else:
        params = dict(params)
        if any(k in params for k in ("full_attention", "sliding_attention")):
            raise UnsupportedRopeError(
                f"config: per-layer-type rope_parameters {sorted(params)} are not supported"
            )
        params.setdefault("rope_theta", d.get("rope_theta", default_theta))
    partial = params.pop("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise UnsupportedRopeError(f"config: partial_rotary_factor {partial} is not supported")
    kind = params.get("rope_type") or params.get("type") or DEFAULT
    if kind not in ROPE_TYPES:
        raise UnsupportedRopeError(
            f"config: rope_type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
        )
    unknown = sorted(k for k, v in params.items() if k not in _KEYS[kind] and v is not None)
    if unknown:
        raise UnsupportedRopeError(f"config: rope parameter(s) {unknown} of {kind!r} rope")
    theta = float(params["rope_theta"])
    if kind == DEFAULT:
        return RopeConfig(DEFAULT, theta)
    factor = params.get("factor")
    if not isinstance(factor, (int, float)) or factor <= 0:
        raise ValueError(f"config: {kind} rope needs a positive factor, got {factor!r}")
    if kind == LINEAR:
        return RopeConfig(LINEAR, theta, float(factor))
    original = int(
        params.get("original_max_position_embeddings")
        or d.get("original_max_position_embeddings")
        or max_positions
    )
    return RopeConfig(
        YARN,
        theta,
        float(factor),
        original,
        float(params.get("beta_fast") or YARN_BETA_FAST),
        float(params.get("beta_slow") or YARN_BETA_SLOW),
        params.get("attention_factor"),
        params.get("mscale"),
        params.get("mscale_all_dim"),
        bool(params.get("truncate", True)),
    )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 · mscale · ln(scale) + 1`` (1 without scaling)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq_and_scale(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [dim/2] float32, cos/sin scale)`` of a rope over `dim` rotated dimensions."""
    # torch is imported where the math is, not at the top: the config reader (and through it
    # the router, which reads a checkpoint's config) loads no torch
    import torch

    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    pos_freqs = rope.theta**exponents
    base = 1.0 / pos_freqs
    if rope.rope_type == DEFAULT:
        return base, 1.0
    if rope.rope_type == LINEAR:
        return base / rope.factor, 1.0
    scale = rope.attention_factor
    if scale is None:
        if rope.mscale and rope.mscale_all_dim:
            scale = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(
                rope.factor, rope.mscale_all_dim
            )
        else:
            scale = yarn_mscale(rope.factor)

    def correction_dim(rotations: float) -> float:
        # the dimension whose wavelength turns `rotations` times over the original context
        original = rope.original_max_position_embeddings
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp  # high-frequency dimensions keep their frequency
    inv_freq = (base / rope.factor) * (1 - extrapolated) + base * extrapolated
    return inv_freq, float(scale)


class Rotary:
    """RoPE in the HF "rotate half" convention (the layout of HF q/k projection weights)."""

    def __init__(self, head_dim: int, rope: RopeConfig, device):
        inv_freq, self.scale = inv_freq_and_scale(rope, head_dim)
        self.inv_freq = inv_freq.to(device)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x ``[T, heads, D]``, positions ``[T]`` -> x rotated by each token's position."""
        import torch

        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos = (freqs.cos() * self.scale)[:, None, :]
        sin = (freqs.sin() * self.scale)[:, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
