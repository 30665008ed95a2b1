"""Model sources for the fetch and end-to-end tests: a tiny real Llama in HF format, served by
the stand-in hub (e2e/fake_hub.py: the hub's HTTP for a directory, driven by the unmodified
huggingface_hub client) and by a real MinIO server (e2e/minio_server.py, built from Go modules)."""
from __future__ import annotations

import shutil

import pytest

from e2e.fake_hub import FakeHub
from e2e.minio_server import MinioServer

PUBLIC_REPO, PRIVATE_REPO, HF_TOKEN = "kaon-test/tiny-llama", "kaon-test/private-llama", "hf_kaon_test_token"
BUCKET, PREFIX = "models", "tiny-llama"
# 4 attention heads, 2 KV heads, MLP width 128: tensorParallelSize 3 does not fit, 2 does.
TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, gguf_path):
    """A tiny random Llama saved by transformers' save_pretrained, with the bundled tokenizer and chat template."""
    import torch
    import transformers

    from support.hf_dirs import write_hf_dir

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    write_hf_dir(model, path, gguf_path, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}, chat_template=True)
    (path / "README.md").write_text("# tiny-llama\nnot needed by the engine: never downloaded\n")
    (path / "original").mkdir()
    (path / "original" / "consolidated.00.pth").write_bytes(b"\0" * 4096)  # another format: left on the hub
    return path


@pytest.fixture(scope="session")
def hf_hub(tmp_path_factory, tiny_llama_dir):
    """The stand-in hub with a public and a private (token-only) copy of the tiny Llama."""
    root = tmp_path_factory.mktemp("hub")
    for repo in (PUBLIC_REPO, PRIVATE_REPO):
        shutil.copytree(tiny_llama_dir, root / repo)
    with FakeHub(root, tokens={PRIVATE_REPO: HF_TOKEN}) as hub:
        yield hub


@pytest.fixture(scope="session")
def minio(tmp_path_factory, tiny_llama_dir):
    """A real MinIO server with the tiny Llama under s3://models/tiny-llama."""
    with MinioServer(tmp_path_factory.mktemp("minio")) as server:
        server.upload_dir(BUCKET, PREFIX, tiny_llama_dir)
        yield server
