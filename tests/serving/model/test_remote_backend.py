"""The experts-backend interface is the AttentionClient's: expert servers that load their
experts from the checkpoint, reached through a client, generate what the local model does."""

from __future__ import annotations

import pytest
from moecomm.runtime import ExpertServer
from moecomm.runtime.control import HttpServer, make_app
from moecomm.testing import connect_client
from moecomm_serving.engine.generate import generate
from moecomm_serving.model.checkpoint import Checkpoint
from moecomm_serving.model.tokenizer import ByteTokenizer
from moecomm_serving.model.transformer import load_model
from moecomm_serving.types import SamplingParams

HOSTED = ({i: range(0, 8) for i in range(4)}, {i: range(8, 16) for i in range(4)})


@pytest.fixture
def servers(mixtral_dir):
    """Two in-process expert servers: experts 0-7 and 8-15 of every layer."""
    ckpt = Checkpoint(mixtral_dir)
    running = []
    try:
        for k, hosted in enumerate(HOSTED):
            server = ExpertServer(ckpt.read_experts(hosted), f"s{k}")
            http = HttpServer(make_app(server))
            server.start()
            running.append((server, http, http.start()))
        yield [url for _, _, url in running]
    finally:
        for server, http, _ in running:
            http.stop()
            server.close()


def test_generation_through_expert_servers(servers, mixtral_dir, mixtral):
    cfg = mixtral.config
    client = connect_client(
        servers, cfg.hidden_size, cfg.num_experts_per_tok, 64, client_id=1, timeout=20.0
    )
    try:
        remote = load_model(mixtral_dir, experts=client)
        tok = ByteTokenizer()
        prompts = [tok.encode("remote"), tok.encode("experts, two servers")]
        params = SamplingParams(max_new_tokens=6, ignore_eos=True)
        got = [g.tokens for g in generate(remote, prompts, params)]
        want = [g.tokens for g in generate(mixtral, prompts, params)]
        assert got == want
    finally:
        client.close()
