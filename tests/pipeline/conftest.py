"""Tiny checkpoints for pipeline tests, written once per session; one intra-op thread."""

from __future__ import annotations

import pytest
import torch
from moecomm_serving.tiny import write_tiny

# Nine layers split 3/3/3 over three stages let the last stage give away two layers, onto two
# receivers, so a redistribution moves layers across both boundaries at once.
THREE_STAGE_LAYERS = 9


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("pipe-tiny-mixtral")
    write_tiny(str(path), "mixtral", seed=0)
    return path


@pytest.fixture(scope="session")
def nine_layer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("pipe-tiny-qwen-9")
    write_tiny(str(path), "qwen2_moe", seed=3, overrides={"num_hidden_layers": THREE_STAGE_LAYERS})
    return path
