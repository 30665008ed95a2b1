"""Open the checkpoint a model id names, whatever its format."""
from __future__ import annotations

from pathlib import Path

from kaon_runtime.loader.checkpoint import Checkpoint
from kaon_runtime.loader.gguf_file import load_gguf
from kaon_runtime.loader.hf_dir import load_hf_dir, model_config_from_hf
from kaon_runtime.loader.random_weights import RANDOM_SCHEME, hf_config, random_weights, tensor_shapes
from kaon_runtime.loader.resolve import resolve_model
from kaon_runtime.loader.tokenizer import Tokenizer


def open_checkpoint(model: str) -> Checkpoint:
    """The checkpoint a model id names: random://<shape>, builtin://<name>, a .gguf file or an HF directory."""
    if model.startswith(RANDOM_SCHEME):
        name = model[len(RANDOM_SCHEME):]
        raw = hf_config(name)
        config = model_config_from_hf(raw)
        tokenizer = Tokenizer.bytes_only(raw.get("bos_token_id"), raw.get("eos_token_id"))
        return Checkpoint(Path(name), config, tokenizer, len(tensor_shapes(config)), lambda: random_weights(config))
    return load_checkpoint(resolve_model(model))


def load_checkpoint(path: Path) -> Checkpoint:
    if path.is_file():
        return load_gguf(path)
    return load_hf_dir(path)
