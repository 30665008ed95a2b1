"""A random untied Llama-shaped model as an HF directory, for the parallelism benchmarks (bench/pipeline.py,
bench/pipeline_c_step.py, bench/tp_step.py): transformers writes it (weights normal, 0.05), the bundled GGUF's
vocabulary is its tokenizer. Its answers mean nothing; its shapes are what is measured.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

BUNDLED = "builtin://smollm2-135m-instruct"


def write_model(path: Path, layers: int, hidden: int, intermediate: int | None = None) -> None:
    """`layers` layers of width `hidden` (heads of 64, KV heads of 128), MLP width `intermediate`
    (default 11/4 of hidden, as bench/pipeline.py first measured)."""
    import torch
    import transformers

    from kaon_runtime.loader import resolve_model
    from kaon_runtime.loader.gguf_file import load_gguf

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=hidden,
                                      intermediate_size=intermediate or hidden * 11 // 4,
                                      num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                      num_key_value_heads=hidden // 128, max_position_embeddings=1024,
                                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    model.save_pretrained(path, safe_serialization=True)
    load_gguf(resolve_model(BUNDLED)).tokenizer.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
