"""A checkpoint's Jinja chat template, rendered the way transformers' ``apply_chat_template``
renders it, so a served checkpoint sees the prompts it was trained on.

The environment matches transformers': a sandbox (templates come with downloaded checkpoints),
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that
does not HTML-escape, the globals ``raise_exception`` and ``strftime_now``, a ``{% generation %}``
block that renders its body, and the variables ``messages``, ``tools``, ``documents``,
``add_generation_prompt`` and the special tokens (``bos_token``, ``eos_token``, ...).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from moecomm.errors import MoecommError


class ChatTemplateError(MoecommError, ValueError):
    """The template refused the conversation (``raise_exception``) or failed to render."""


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson HTML-escapes '<' and '>', which would change the prompt's text.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; for
    serving it renders its body unchanged."""

    tags = frozenset({"generation"})

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplateRenderer:
    """A compiled chat template with the checkpoint's special tokens bound."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]):
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from None
        self.special_tokens = dict(special_tokens)

    def render(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for `messages` (dicts with ``role`` and ``content``)."""
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except Exception as exc:  # template code is checkpoint data: any failure is its refusal
            raise ChatTemplateError(
                f"the model's chat template refused the messages: {exc}"
            ) from None
