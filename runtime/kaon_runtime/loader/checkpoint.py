"""Read a checkpoint (GGUF file or HF directory) into a config, a tokenizer and HF-named weights."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from kaon_runtime.config import ModelConfig
from kaon_runtime.errors import ModelLoadError
from kaon_runtime.loader.random_weights import RANDOM_SCHEME, hf_config, random_weights, tensor_shapes
from kaon_runtime.loader.resolve import resolve_model
from kaon_runtime.loader.tokenizer import Tokenizer

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


@dataclass(slots=True)
class Checkpoint:
    """What the model runner needs; `weights()` yields (HF parameter name, tensor) lazily."""

    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    num_tensors: int
    weights: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    # GGUF only: the raw blocks of the Q4_1 tensors, HF-named, rows in HF order, uint8 [rows, K / 32, 20].
    q4_1_blocks: Callable[[], Iterator[tuple[str, torch.Tensor]]] | None = None


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
        from kaon_runtime.loader.gguf_file import load_gguf
        return load_gguf(path)
    return load_hf_dir(path)


# ---- HF directories -------------------------------------------------------------------

_HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


def load_hf_dir(path: Path) -> Checkpoint:
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {exc}") from exc
    config = model_config_from_hf(raw)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} holds no *.safetensors files")
    from safetensors import safe_open

    def weights():
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)
            except Exception as exc:  # safetensors raises its own error types
                raise ModelLoadError(f"corrupt safetensors file {file.name}: {exc}") from exc

    num_tensors = 0
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                num_tensors += len(list(f.keys()))
        except Exception as exc:
            raise ModelLoadError(f"corrupt safetensors file {file.name}: {exc}") from exc
    return Checkpoint(path, config, Tokenizer.from_hf_dir(path), num_tensors, weights)


def model_config_from_hf(raw: dict) -> ModelConfig:
    arch_names = raw.get("architectures") or []
    arch = next((_HF_ARCHITECTURES[a] for a in arch_names if a in _HF_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(f"unsupported architecture {arch_names}; supported: {sorted(_HF_ARCHITECTURES)}")
    try:
        heads = raw["num_attention_heads"]
        rope = raw.get("rope_scaling") or raw.get("rope_parameters")
        rope_theta = raw.get("rope_theta") or (rope or {}).get("rope_theta", 10000.0)
        if rope and rope.get("rope_type", rope.get("type")) in (None, "default"):
            rope = None
        return ModelConfig(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
        )
    except KeyError as exc:
        raise ModelLoadError(f"config.json lacks {exc}") from exc
