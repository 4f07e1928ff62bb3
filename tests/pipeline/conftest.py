"""Tiny checkpoints for pipeline tests, written once per session."""

from __future__ import annotations

import pytest
from moecomm_serving.model.tiny import write_tiny

# Nine layers split 3/3/3 over three stages let the last stage give away two layers, onto two
# receivers, so a redistribution moves layers across both boundaries at once.
THREE_STAGE_LAYERS = 9


@pytest.fixture(scope="session")
def tiny_dir(tiny_mixtral_dir):
    return tiny_mixtral_dir


@pytest.fixture(scope="session")
def nine_layer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("pipe-tiny-qwen-9")
    write_tiny(str(path), "qwen2_moe", seed=3, overrides={"num_hidden_layers": THREE_STAGE_LAYERS})
    return path
