"""A tiny random Qwen3 (the architecture of Qwen3-Embedding) as an HF directory, and the
embeddings transformers computes from it: the reference kaon's /v1/embeddings must equal; and
one `kaon serve --task embed` of it for the session (the server's and the router's tests)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from support.hf_dirs import write_hf_dir
from support.server import Server

EMBED_MODEL = "tiny-qwen3-embed"

CONFIG = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=True)


def build_embed_dir(path, gguf_path):
    """Write the model to `path`; return it (float32, eval) for the reference."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(**CONFIG)
    config._attn_implementation = "eager"
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # norms away from ones: their weights matter
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    write_hf_dir(model, path, gguf_path, {"eos_token": "<|im_end|>"})
    return model


def reference_embedding(model, token_ids: list[int], pooling: str = "last") -> torch.Tensor:
    """transformers' final hidden states (after the last norm) pooled and L2-normalized, in float32."""
    with torch.inference_mode():
        hidden = model.model(torch.tensor([token_ids])).last_hidden_state[0].float()
    pooled = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return F.normalize(pooled, dim=0)


@pytest.fixture(scope="session")
def embed_server(tmp_path_factory, gguf_path):
    """(the server, the transformers model it serves): built and started once, not once per module."""
    path = tmp_path_factory.mktemp("qwen3-embed")
    hf = build_embed_dir(path, gguf_path)
    srv = Server(tmp_path_factory.mktemp("serve-embed"), "--model", str(path), "--served-model-name", EMBED_MODEL,
                 "--task", "embed")
    yield srv, hf
    srv.stop()
