"""Bubble-aware layer redistribution (DynaPipe).

The last pipeline stage runs its layers *and* samples. With layers split evenly it is the
slowest stage by ``T_sample`` and every other stage idles that long per micro-batch (a bubble).
Moving ``k`` layers off the last stage onto ``m = min(k, S − 1)`` upstream stages shortens the
last stage by ``k·T_layer`` and lengthens each receiver by ``(k/m)·T_layer``; the misalignment

    Δ(k) = |T_sample − k·T_layer − (k/m)·T_layer|          (Δ(0) = T_sample)

is what remains of the bubble. The scheduler picks the k with the smallest Δ (the smallest k
among ties: fewer layers, less KV to migrate), and applies a new k only once it has been chosen
at every position of a stability window, so a load sitting on a decision boundary does not make
the pipeline migrate KV back and forth.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# Steps a new choice must hold before it is applied: long enough to ride out a burst of
# prefills or a noisy timing, short enough (~ a second of decode) to follow a load shift.
DEFAULT_WINDOW = 25


def uniform_counts(num_layers: int, num_stages: int) -> list[int]:
    """An even split; the remainder goes to the earliest stages (never to the sampling one)."""
    if num_stages < 1 or num_layers < num_stages:
        raise ValueError(
            f"need 1 <= num_stages <= num_layers, got {num_stages} stages for {num_layers} layers"
        )
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]


def max_moves(num_layers: int, num_stages: int) -> int:
    """Most layers the last stage can give away and still own one."""
    return uniform_counts(num_layers, num_stages)[-1] - 1 if num_stages > 1 else 0


def stage_counts(num_layers: int, num_stages: int, k: int) -> list[int]:
    """Layers per stage after moving k layers off the last stage.

    The receivers are the m = min(k, S − 1) stages just before the last one (boundaries further
    upstream do not move, so less KV migrates); each gets ``k // m`` layers, and the remainder
    goes one each to those nearest the last stage.
    """
    if not 0 <= k <= max_moves(num_layers, num_stages):
        raise ValueError(
            f"k must be in [0, {max_moves(num_layers, num_stages)}] for {num_layers} layers on "
            f"{num_stages} stages, got {k}"
        )
    counts = uniform_counts(num_layers, num_stages)
    if k == 0:
        return counts
    m = min(k, num_stages - 1)
    share, extra = divmod(k, m)
    receivers = list(range(num_stages - 1 - m, num_stages - 1))
    for j, s in enumerate(reversed(receivers)):
        counts[s] += share + (1 if j < extra else 0)
    counts[-1] -= k
    return counts


def stage_ranges(num_layers: int, num_stages: int, k: int) -> list[range]:
    """Contiguous layer ranges of the stages after moving k layers off the last one."""
    out, start = [], 0
    for c in stage_counts(num_layers, num_stages, k):
        out.append(range(start, start + c))
        start += c
    return out


def misalignment(k: int, num_stages: int, t_layer: float, t_sample: float) -> float:
    """Δ(k) in seconds (see the module docstring)."""
    if k == 0:
        return abs(t_sample)
    m = min(k, num_stages - 1)
    return abs(t_sample - k * t_layer - (k / m) * t_layer)


def best_k(num_stages: int, t_layer: float, t_sample: float, k_max: int) -> int:
    """The k in ``[0, k_max]`` minimizing Δ; the smallest one among ties."""
    if num_stages < 2:
        return 0
    return min(range(k_max + 1), key=lambda k: (misalignment(k, num_stages, t_layer, t_sample), k))


@dataclass(frozen=True)
class Decision:
    """What :meth:`BubbleScheduler.observe` concluded at one step."""

    chosen: int  # the Δ-minimizing k of this step
    applied: int  # the k in force after this step
    changed: bool  # True when this step switched the applied k
    ranges: tuple[range, ...]  # layer ranges of the applied k


class BubbleScheduler:
    """Chooses how many layers the last stage sheds, with a stability window.

    Args:
        num_layers, num_stages: the pipeline's shape.
        k_max: most layers moved (default: all but one of the last stage's); a deployment that
            preloads fewer layers' weights on the receivers passes that count.
        window: steps a new k must be chosen at, consecutively, before it is applied.
        initial_k: the k in force at start (0: a uniform split).
    """

    def __init__(
        self,
        num_layers: int,
        num_stages: int,
        k_max: int | None = None,
        window: int = DEFAULT_WINDOW,
        initial_k: int = 0,
    ):
        limit = max_moves(num_layers, num_stages)
        k_max = limit if k_max is None else k_max
        if not 0 <= k_max <= limit:
            raise ValueError(f"k_max must be in [0, {limit}], got {k_max}")
        if window < 1:
            raise ValueError(f"window must be >= 1 step, got {window}")
        if not 0 <= initial_k <= k_max:
            raise ValueError(f"initial_k must be in [0, {k_max}], got {initial_k}")
        self.num_layers, self.num_stages = num_layers, num_stages
        self.k_max, self.window = k_max, window
        self.k = initial_k
        self.recent: deque[int] = deque(maxlen=window)

    @property
    def ranges(self) -> tuple[range, ...]:
        return tuple(stage_ranges(self.num_layers, self.num_stages, self.k))

    def choose(self, t_layer: float, t_sample: float) -> int:
        """The Δ-minimizing k for these times, without touching the window."""
        if t_layer < 0 or t_sample < 0:
            raise ValueError(f"times must be >= 0, got T_layer={t_layer}, T_sample={t_sample}")
        return best_k(self.num_stages, t_layer, t_sample, self.k_max)

    def observe(self, t_layer: float, t_sample: float) -> Decision:
        """Records this step's choice; switches k when the whole window agrees on a new one."""
        chosen = self.choose(t_layer, t_sample)
        self.recent.append(chosen)
        changed = (
            chosen != self.k
            and len(self.recent) == self.window
            and all(c == chosen for c in self.recent)
        )
        if changed:
            self.k = chosen
        return Decision(chosen, self.k, changed, self.ranges)
