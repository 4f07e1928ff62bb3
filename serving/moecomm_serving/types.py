"""The serving layer's plain data, below every other layer: what a request asks for
(:class:`SamplingParams`), what the engine answers (:class:`TokenEvent`, :class:`FinishEvent`,
:class:`ErrorEvent`, and for the prefill/decode split :class:`HandoffEvent` and
:class:`Resume`), and what a handed-off KV cache is (:class:`KvPackage`, its metadata).

Nothing here needs torch to import (the router, which forwards HTTP, imports these and no model
code); tensors and pools appear only as the values of fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# A request with no deadline of its own gets this one (queueing included): nothing waits
# forever.
DEFAULT_REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens.

    ``temperature == 0`` is greedy (argmax). Otherwise logits are divided by the temperature,
    the smallest set of tokens whose probability reaches ``top_p`` is kept, and a token is drawn
    with a generator seeded by ``seed`` (a fresh random seed when None;
    :func:`moecomm_serving.engine.generate.make_generator`).
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class KvPackage:
    """What a handed-off KV cache is, without its bytes: the metadata a decode front end checks
    once, before it reserves blocks for it (:func:`~moecomm_serving.kv.blocks.check_package`),
    and that travels in the hand-off's reservation call
    (:class:`~moecomm_serving.disagg.schema.ReserveCall`). The bytes themselves move block to
    block between the two front ends' KV pools (:mod:`moecomm.wire.kv`), never in a package.

    ``length`` tokens in ``ceil(length / block_tokens)`` blocks, every layer of ``layers``;
    ``dtype`` is the element type's name (``"float32"``); ``kv_shape`` is
    ``(heads, key width, value width)``.
    """

    version: int
    length: int  # tokens cached
    block_tokens: int
    layers: tuple[int, ...]
    kv_shape: tuple[int, int, int]
    dtype: str

    @property
    def num_blocks(self) -> int:
        return -(-self.length // self.block_tokens)

    def meta(self) -> dict[str, Any]:
        """Every field as JSON-ready values."""
        return {
            "version": self.version,
            "length": self.length,
            "block_tokens": self.block_tokens,
            "layers": list(self.layers),
            "kv_shape": list(self.kv_shape),
            "dtype": self.dtype,
        }


@dataclass(frozen=True)
class TokenEvent:
    token: int
    time: float  # time.monotonic() when the step that produced it returned
    finish: str | None = None  # set on the last token (a FinishEvent with it follows)


@dataclass(frozen=True)
class FinishEvent:
    reason: str  # "stop" or "length" (Generation.finish_reason)
    time: float


@dataclass(frozen=True)
class ErrorEvent:
    message: str
    status: int  # the HTTP status a non-streaming request should answer with
    time: float


@dataclass(frozen=True)
class HandoffEvent:
    """A prefill-only request (``EngineRequest.handoff``) ends here: its first token, its KV
    cache's blocks held for the hand-off (a :class:`~moecomm_serving.kv.blocks.HeldBlocks`
    whose ``.package`` is the :class:`KvPackage`; whoever takes the event releases them), the
    sampler's state after the draw (a torch generator state; None for greedy) and the prompt
    tokens the prefix cache supplied. Sent instead of that token's TokenEvent (the decode side
    continues)."""

    token: int
    package: Any  # kv.blocks.HeldBlocks (a layer above this module)
    rng_state: object
    cached_tokens: int
    time: float


@dataclass(frozen=True)
class Resume:
    """What a decode-side request starts from (``EngineRequest.resume``): the blocks of this
    engine's pool the handed-off KV was written into (a
    :class:`~moecomm_serving.kv.blocks.HeldBlocks`, its package checked when the blocks were
    reserved; the engine's sequence adopts them), the tokens generated so far (at least the
    prefill's first) and the sampler's state."""

    package: Any  # kv.blocks.HeldBlocks (a layer above this module)
    tokens: list[int]
    rng_state: object = None


Event = TokenEvent | FinishEvent | ErrorEvent | HandoffEvent
