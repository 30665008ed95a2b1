"""HF-format directories for tiny random models, written by transformers' own save_pretrained."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from kaon_runtime.loader.gguf_file import load_gguf


def write_hf_dir(model, path, gguf_path, tokenizer_config: dict, *, chat_template: bool = False) -> None:
    """Save a tiny random transformers model as an HF directory for kaon: weights spread so that
    greedy choices are far from ties, and the bundled GGUF's vocabulary (any byte-level one of
    the right size) as tokenizer.json."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer = _tokenizer(Path(gguf_path))
    tokenizer.backend.save(str(path / "tokenizer.json"))
    if chat_template:
        tokenizer_config = {"chat_template": tokenizer.chat_template, **tokenizer_config}
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


@functools.lru_cache(maxsize=2)
def _tokenizer(gguf_path: Path):
    """The GGUF file's tokenizer, read once per process: reading the bundled file's 49k tokens and merges
    is ~1.5 s of CPU on a Zen 2, which every tiny directory paid again. Only read from (saved, its template)."""
    return load_gguf(gguf_path).tokenizer
