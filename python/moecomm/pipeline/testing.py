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

import torch

HIDDEN = 8  # any width works; small keeps the slots small


def expected_token(token: int, num_layers: int) -> int:
    """What the last stage samples for a sequence whose last fed token is `token`."""
    return token + num_layers * (num_layers + 1) // 2


class FakeStage:
    """See the module docstring. `slow` maps ``(layer, step)`` to seconds to sleep before that
    layer runs (to hold a migration source back)."""

    def __init__(self, index: int, owned: range, log_dir: str, slow: dict | None = None):
        self.index, self.owned = index, owned
        self.kv: dict[int, dict[int, list[int]]] = {}  # seq -> layer -> positions seen
        self.slow = {tuple(k): v for k, v in (slow or {}).items()}
        self.log_path = os.path.join(log_dir, f"stage{index}.jsonl")
        self.step = -1

    def _log(self, event: str, **kw) -> None:
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
        rows, t = [], -1
        for n in self.num_new:
            t += n
            rows.append(t)
        return [int(h[r, 0]) for r in rows]

    def export_kv(self, layer: int) -> dict[int, list[int]]:
        out = {sid: layers.pop(layer) for sid, layers in self.kv.items()}
        self._log("export", layer=layer, step=self.step)
        return out

    def import_kv(self, layer: int, package: dict[int, list[int]]) -> None:
        for sid, seen in package.items():
            if sid in self.kv:
                self.kv[sid][layer] = seen
        self._log("import", layer=layer, step=self.step)

    def free(self, seq_ids: Sequence[int]) -> None:
        for sid in seq_ids:
            self.kv.pop(sid, None)


def make_fake_stage(log_dir: str, slow: dict | None, index: int, preload: range, owned: range):
    """Picklable factory: ``functools.partial(make_fake_stage, log_dir, slow)``."""
    return FakeStage(index, owned, log_dir, slow)


def read_log(log_dir: str, index: int) -> list[dict]:
    path = os.path.join(log_dir, f"stage{index}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]
