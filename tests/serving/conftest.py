"""Tiny random checkpoints written once per test session, in both supported layouts."""

from __future__ import annotations

import pytest
import torch
from moecomm_serving.model.tiny import write_tiny
from moecomm_serving.model.transformer import load_model


@pytest.fixture(scope="session")
def mixtral_dir(tiny_mixtral_dir):
    return tiny_mixtral_dir


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2-moe")
    write_tiny(str(path), "qwen2_moe", seed=1)
    return path


@pytest.fixture(scope="session")
def mixtral(mixtral_dir):
    return load_model(mixtral_dir, dtype=torch.float32)


@pytest.fixture(scope="session")
def qwen(qwen_dir):
    return load_model(qwen_dir, dtype=torch.float32)


@pytest.fixture(params=["mixtral", "qwen"])
def model(request):
    """Both layouts, for tests that must hold for each."""
    return request.getfixturevalue(request.param)
