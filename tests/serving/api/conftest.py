"""The tiny checkpoint (written once per session), and real front ends on 127.0.0.1:0."""

from __future__ import annotations

import pytest
import torch
from frontend_helpers import MAX_BATCH_TOKENS, MODEL_NAME
from moecomm_serving.api.app import FrontendSettings, make_frontend_app, start_frontend
from moecomm_serving.disagg.routes import PdRoutes
from moecomm_serving.engine.generate import generate
from moecomm_serving.model.tokenizer import load_tokenizer
from moecomm_serving.model.transformer import load_model
from moecomm_serving.types import SamplingParams


@pytest.fixture(scope="session")
def tiny_dir(tiny_mixtral_dir):
    return tiny_mixtral_dir


@pytest.fixture(scope="session")
def model(tiny_dir):
    return load_model(tiny_dir, dtype=torch.float32)


@pytest.fixture(scope="session")
def tok(tiny_dir, model):
    return load_tokenizer(tiny_dir, model.config)


class Served:
    """A running front end: its URL and its :class:`Frontend` (engine stats, metrics)."""

    def __init__(self, app):
        self.app = app
        self.frontend = app.state.frontend
        self.server = start_frontend(app)
        self.url = self.server.url

    @property
    def stats(self):
        return self.frontend.engine.stats

    def stop(self):
        self.server.stop()


@pytest.fixture(scope="session")
def serve(tok):
    """Factory: ``serve(model, tokenizer=None, role=None, **FrontendSettings fields)`` (the tiny
    byte tokenizer by default; a `role` adds the prefill/decode split's routes); stopped at the
    end of the session."""
    running = []

    def start(model, tokenizer=None, role=None, **kwargs):
        kwargs.setdefault("max_batch_tokens", MAX_BATCH_TOKENS)
        settings = FrontendSettings(MODEL_NAME, **kwargs)
        split = [] if role is None else [PdRoutes(role)]
        s = Served(make_frontend_app(model, tokenizer or tok, settings, split))
        running.append(s)
        return s

    yield start
    for s in running:
        s.stop()


@pytest.fixture(scope="session")
def served(serve, model):
    """The default front end over local experts (no batching window)."""
    return serve(model)


@pytest.fixture(scope="session")
def solo(model):
    """In-process reference: the tokens `generate` produces for one prompt alone."""
    cache = {}

    def run(prompt_ids, **params) -> list[int]:
        key = (tuple(prompt_ids), tuple(sorted(params.items())))
        if key not in cache:
            (g,) = generate(model, [prompt_ids], SamplingParams(**params))
            cache[key] = g.tokens
        return cache[key]

    return run
