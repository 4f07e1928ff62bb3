"""A model-free :class:`~moecomm.pipeline.stage.StageCompute` whose outputs can be predicted
exactly, for testing the stage runtime and its KV migration without a model.

Hidden states are ``[T, HIDDEN]`` float32; every column of a token's row carries its value. Layer
``i`` adds ``i + 1`` to every row, so after all layers a token's row holds
``token + Σ_i (i + 1)`` exactly. The "KV cache" of (sequence, layer) is the list of positions that
layer has seen for that sequence: a layer checks that it holds exactly ``0 .. past − 1`` before it
appends, so a cache lost, duplicated or stale after a migration is an error, not a wrong number.
Each stage appends timestamped events (CLOCK_MONOTONIC, comparable across processes) to a
per-stage log file, from which tests read the order of computation and migration.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

HIDDEN = 8  # any width works; small keeps the slots small


def expected_token(token: int, num_layers: int) -> int:
    """What the last stage samples for a sequence whose last fed token is `token`."""
    return token + num_layers * (num_layers + 1) // 2


@dataclass(frozen=True)
class EmulatedCost:
    """Seconds a layer / the sampling step *sleeps* (the predictor's model with given
    coefficients): stands in for device compute, so stages on a small shared host run in
    parallel the way stages on separate accelerators would."""

    phi1: float
    phi2: float
    eps: float
    chunk: float
    alpha: float
    beta: float

    def layer(self, num_new: Sequence[int], lengths: Sequence[int]) -> float:
        sn = sum(num_new)
        snl = sum(n * length for n, length in zip(num_new, lengths, strict=True))
        return self.phi1 * sn + self.phi2 * snl + self.eps * len(num_new) + self.chunk

    def sample(self, num_decode: int) -> float:
        return self.alpha * num_decode + self.beta


class FakeStage:
    """See the module docstring. `slow` maps ``(layer, step)`` to seconds to sleep before that
    layer runs (to hold a migration source back); `cost` makes every layer and sampling call
    sleep as an emulated device would; `log_dir` None keeps no log."""

    def __init__(
        self,
        index: int,
        owned: range,
        log_dir: str | None,
        slow: dict | None = None,
        cost: EmulatedCost | None = None,
    ):
        self.index, self.owned = index, owned
        self.kv: dict[int, dict[int, list[int]]] = {}  # seq -> layer -> positions seen
        self.slow = {tuple(k): v for k, v in (slow or {}).items()}
        self.cost = cost
        self.log_path = os.path.join(log_dir, f"stage{index}.jsonl") if log_dir else None
        self.step = -1

    def _log(self, event: str, **kw) -> None:
        if self.log_path is None:
            return
        with open(self.log_path, "a") as f:
            f.write(json.dumps({"t": time.monotonic(), "event": event, **kw}) + "\n")

    def set_layers(self, layers: range) -> None:
        self.owned = layers

    def begin(self, seq_ids: Sequence[int], past: Sequence[int], num_new: Sequence[int]) -> None:
        self.step += 1  # every stage sees every step, in order
        self.seq_ids, self.past, self.num_new = list(seq_ids), list(past), list(num_new)
        for sid, p in zip(seq_ids, past, strict=True):
            if sid not in self.kv:
                if p:
                    raise RuntimeError(f"sequence {sid} is unknown but has {p} tokens")
                self.kv[sid] = {i: [] for i in self.owned}

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens.to(torch.float32)[:, None].expand(-1, HIDDEN).contiguous()

    def layer(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        delay = self.slow.get((layer, self.step))
        if delay:
            time.sleep(delay)
        if self.cost is not None:
            lengths = [p + n for p, n in zip(self.past, self.num_new, strict=True)]
            time.sleep(self.cost.layer(self.num_new, lengths))
        self._log("layer", layer=layer, step=self.step)
        for sid, p, n in zip(self.seq_ids, self.past, self.num_new, strict=True):
            seen = self.kv[sid].get(layer)
            if seen is None:
                raise RuntimeError(f"stage {self.index}: no cache of layer {layer} for seq {sid}")
            if seen != list(range(p)):
                raise RuntimeError(
                    f"stage {self.index}: layer {layer} seq {sid} holds {len(seen)} positions, "
                    f"expected 0..{p - 1}"
                )
            seen.extend(range(p, p + n))
        return h + (layer + 1)

    def sample(self, h: torch.Tensor) -> list[int]:
        if self.cost is not None:
            time.sleep(self.cost.sample(len(self.num_new)))
        rows, t = [], -1
        for n in self.num_new:
            t += n
            rows.append(t)
        return [int(h[r, 0]) for r in rows]

    def export_kv(self, layer: int) -> dict[str, torch.Tensor]:
        out = {
            str(sid): torch.tensor(layers.pop(layer), dtype=torch.int64)
            for sid, layers in self.kv.items()
        }
        self._log("export", layer=layer, step=self.step)
        return out

    def import_kv(self, layer: int, package: dict[str, torch.Tensor]) -> None:
        for sid, seen in package.items():
            if int(sid) in self.kv:
                self.kv[int(sid)][layer] = seen.tolist()
        self._log("import", layer=layer, step=self.step)

    def close(self) -> None:
        pass  # holds nothing outside the process

    def free(self, seq_ids: Sequence[int]) -> None:
        for sid in seq_ids:
            self.kv.pop(sid, None)


def make_fake_stage(
    log_dir: str | None,
    slow: dict | None,
    index: int,
    preload: range,
    owned: range,
    cost: EmulatedCost | None = None,
):
    """Picklable factory: ``functools.partial(make_fake_stage, log_dir, slow, cost=...)``."""
    return FakeStage(index, owned, log_dir, slow, cost)


def read_log(log_dir: str, index: int) -> list[dict]:
    path = os.path.join(log_dir, f"stage{index}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]
