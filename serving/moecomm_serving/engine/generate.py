"""Generation with the KV cache: greedy or sampled (temperature, top-p, seeded), batched.

Every request carries its own :class:`SamplingParams` and, when sampling, its own seeded
generator, so a request draws the same tokens whether it runs alone or in a batch. One step
feeds every unfinished sequence's last token; finished sequences leave the batch.
:func:`sample_next` is the per-sequence sampling rule a continuous-batching front end reuses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moecomm_serving.kv.blocks import BlockPool, HeldBlocks, PagedSequence
from moecomm_serving.kv.prefix_cache import PrefixCache
from moecomm_serving.model.transformer import MoETransformer
from moecomm_serving.types import SamplingParams

FINISH_STOP = "stop"  # produced a stop token (end of sequence)
FINISH_LENGTH = "length"  # reached max_new_tokens


DEFAULT_PARAMS = SamplingParams()


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The seeded generator a sampled request draws with (a fresh random seed without one);
    None for greedy decoding."""
    if params.greedy:
        return None
    g = torch.Generator()
    if params.seed is None:
        g.seed()
    else:
        g.manual_seed(params.seed)
    return g


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    """Next token from one sequence's float ``[vocab]`` logits."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float().cpu() / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True)
        # keep a token while the mass before it is still short of top_p (the first always stays)
        keep = (torch.cumsum(sorted_p, dim=-1) - sorted_p) < params.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


class Generation:
    """One request in flight: its cache, its sampler and the tokens it produced so far.

    A continuous-batching scheduler creates one per request whenever it arrives and passes any
    set of unfinished ones to :func:`step`: a new request's first step feeds its whole prompt
    (prefill) in the same forward as the others' single decode tokens.
    """

    def __init__(
        self,
        model: MoETransformer,
        prompt: Sequence[int],
        params: SamplingParams = DEFAULT_PARAMS,
        eos_token_id: int | Sequence[int] | None = None,
        pool: BlockPool | None = None,
        prefix_cache: PrefixCache | None = None,
    ):
        if len(prompt) == 0:
            raise ValueError("every prompt needs at least one token")
        if prefix_cache is not None:
            if pool is None:
                pool = prefix_cache.pool
            elif pool is not prefix_cache.pool:
                raise ValueError("the prefix cache keeps blocks of another pool")
        self.prompt = [int(t) for t in prompt]
        self.params = params
        self.prefix_cache = prefix_cache
        # (a pipeline's model keeps the caches in its stages: it takes no pool)
        self.cache = model.new_sequence() if pool is None else model.new_sequence(pool)
        # Prompt tokens whose keys came from the prefix cache: their prefill is skipped.
        self.cached = 0
        if prefix_cache is not None:
            blocks, self.cached = prefix_cache.match(self.prompt)
            self.cache.adopt(blocks, self.cached)
        self.generator = make_generator(params)
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        eos = model.config.eos_token_id if eos_token_id is None else eos_token_id
        self.stop_ids = set(params.stop_token_ids)
        if eos is not None and not params.ignore_eos:
            # a checkpoint may end generation on several ids (generation_config.json's list)
            self.stop_ids.update(int(e) for e in ([eos] if isinstance(eos, int) else eos))

    @classmethod
    def resume(
        cls,
        model: MoETransformer,
        prompt: Sequence[int],
        params: SamplingParams,
        eos_token_id: int | Sequence[int] | None,
        pool: BlockPool,
        package: HeldBlocks,
        tokens: Sequence[int],
        rng_state: torch.Tensor | None,
    ) -> Generation:
        """A generation handed over by a prefill front end: the KV cache of `prompt` and of
        every token of `tokens` but the last (blocks of `pool` it was written into, a
        :class:`~moecomm_serving.kv.blocks.HeldBlocks` the cache adopts),
        the tokens generated so far, and the sampler's state after drawing them. Its next
        forward feeds ``tokens[-1]``, as if it had run here from the start. Raises ValueError
        for a hand-off that does not fit (other model or block size, wrong length, a sampled
        request without its sampler state, nothing left to generate)."""
        if pool is None:
            raise ValueError("a KV hand-off needs the paged KV cache (kv_block_tokens > 0)")
        g = cls(model, prompt, params, eos_token_id, pool)
        if not tokens:
            raise ValueError("a hand-off carries at least the prefill's first token")
        g.tokens = [int(t) for t in tokens]
        if g.tokens[-1] in g.stop_ids or len(g.tokens) >= params.max_new_tokens:
            raise ValueError("the handed-over request has already finished: nothing to decode")
        if g.generator is not None:
            if not isinstance(rng_state, torch.Tensor):
                raise ValueError("a sampled request's hand-off must carry its sampler state")
            try:
                g.generator.set_state(rng_state)
            except RuntimeError as exc:
                raise ValueError(f"the hand-off's sampler state is not valid: {exc}") from None
        cache = PagedSequence.import_blocks(pool, package)
        want = len(g.prompt) + len(g.tokens) - 1
        if cache.length != want:
            cache.release()
            raise ValueError(
                f"the KV package holds {cache.length} tokens; a prompt of {len(g.prompt)} and "
                f"{len(g.tokens)} generated tokens need {want}"
            )
        g.cache.release()
        g.cache, g.cached = cache, len(g.prompt)
        return g

    def sampler_state(self) -> torch.Tensor | None:
        """The sampler's state (a hand-off carries it so the decode side draws on), or None
        for greedy decoding."""
        return None if self.generator is None else self.generator.get_state()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def feed(self) -> list[int]:
        """Tokens the next forward appends: the prompt first, then the last sampled token."""
        if self.finished:
            raise RuntimeError("this generation has finished")
        return self.prompt[self.cached :] if not self.tokens else self.tokens[-1:]

    def remember(self) -> None:
        """Offers the full blocks cached so far to the prefix cache (after the prefill, so
        requests running meanwhile share the prompt; again at the end, for a next turn)."""
        if self.prefix_cache is not None and not self.cache.released:
            done = self.prompt + self.tokens[:-1] if self.tokens else self.prompt
            self.prefix_cache.insert(done[: self.cache.length], self.cache)

    def release(self) -> None:
        """Frees a paged cache's blocks (those the prefix cache kept stay); idempotent."""
        if isinstance(self.cache, PagedSequence):
            self.cache.release()

    def accept(self, logits: torch.Tensor) -> int:
        """Samples the next token from this sequence's logits and updates the finish state."""
        tok = sample_next(logits, self.params, self.generator)
        self.tokens.append(tok)
        if tok in self.stop_ids:
            self.finish_reason = FINISH_STOP
        elif len(self.tokens) >= self.params.max_new_tokens:
            self.finish_reason = FINISH_LENGTH
        return tok


def step(model: MoETransformer, active: Sequence[Generation]) -> list[int]:
    """One forward for every generation in `active` (none finished); returns their new tokens."""
    logits = model.forward([g.feed() for g in active], [g.cache for g in active])
    return [g.accept(logits[row]) for row, g in enumerate(active)]


def generate(
    model: MoETransformer,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] = DEFAULT_PARAMS,
    eos_token_id: int | Sequence[int] | None = None,
    pool: BlockPool | None = None,
    prefix_cache: PrefixCache | None = None,
) -> list[Generation]:
    """Generates for several prompts of different lengths at once.

    Prefill runs all prompts in one packed forward; then each step decodes one token for every
    unfinished sequence. A sequence stops at ``max_new_tokens``, at one of its
    ``stop_token_ids``, or at `eos_token_id` (the config's by default) unless ``ignore_eos``.
    With `pool` the caches are paged in it (and freed at the end); with `prefix_cache` prompts
    start from the blocks it holds and leave theirs in it.
    """
    per = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(per) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(per)} sampling params")
    out = [
        Generation(model, p, sp, eos_token_id, pool, prefix_cache)
        for p, sp in zip(prompts, per, strict=True)
    ]
    active = list(out)
    try:
        first = True
        while active:
            step(model, active)
            if first:
                for g in active:
                    g.remember()
                first = False
            for g in active:
                if g.finished:
                    g.remember()
                    g.release()
            active = [g for g in active if not g.finished]
    finally:
        for g in out:
            g.release()
    return out


def main(argv: list[str] | None = None) -> None:
    """``python -m moecomm_serving.engine.generate --model DIR --prompt TEXT [--prompt ...]``"""
    import argparse

    from moecomm_serving.model.tokenizer import load_tokenizer
    from moecomm_serving.model.transformer import load_model

    p = argparse.ArgumentParser(description="Generate with a HF-layout MoE checkpoint, in-process")
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    args = p.parse_args(argv)
    model = load_model(args.model)
    tok = load_tokenizer(args.model, model.config)
    params = SamplingParams(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    for text, g in zip(
        args.prompt,
        generate(model, [tok.encode(t) for t in args.prompt], params, tok.eos_ids or None),
        strict=True,
    ):
        print(f"{text!r} -> {tok.decode(g.tokens)!r} ({len(g.tokens)} tokens, {g.finish_reason})")


if __name__ == "__main__":
    main()
