"""Shared fixtures: real two-process servers on free loopback ports."""
from __future__ import annotations

from pathlib import Path

import pytest

from chunkserve.launch import Server, start_server


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The default model, converted into the cache once (the first run takes ~30 s)."""
    from executor_svc.config import default_cache_dir
    from executor_svc.model_loader import resolve_model

    return resolve_model("default", Path(default_cache_dir()))


@pytest.fixture(scope="session")
def launch(tmp_path_factory):
    """Starts servers (start_server's arguments) and stops them all at the end of the session."""
    servers: list[Server] = []

    def _launch(executor_args: list[str], scheduler_args: list[str]) -> Server:
        server = start_server(tmp_path_factory.mktemp("server"), executor_args, scheduler_args)
        servers.append(server)
        return server

    yield _launch
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def tiny_model_path(default_model_path, tmp_path_factory) -> Path:
    """A 2-layer random-weight Llama with SmolLM2's tokenizer: a real server in ~1 s, tokens
    are nonsense but every code path (tokenizer, chat template, vocab checks) is the real one."""
    import shutil

    import torch
    import transformers

    path = tmp_path_factory.mktemp("tiny-model")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
                                      max_position_embeddings=4096, eos_token_id=2, bos_token_id=1)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default_model_path / name).is_file():
            shutil.copy(default_model_path / name, path / name)
    return path
