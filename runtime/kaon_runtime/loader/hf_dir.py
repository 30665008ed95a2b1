"""HF directories (config.json + *.safetensors + tokenizer.json) as a Checkpoint, and config.json as a ModelConfig."""
from __future__ import annotations

import json
from pathlib import Path

from kaon_runtime.config import ModelConfig
from kaon_runtime.errors import ModelLoadError
from kaon_runtime.loader.checkpoint import Checkpoint
from kaon_runtime.loader.mapped_safetensors import mapped_tensors
from kaon_runtime.loader.tokenizer import Tokenizer

# HF class -> our architecture (a key of models.registry). Mistral is Llama with a sliding window.
_HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                     "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2", "Phi3ForCausalLM": "phi3",
                     "MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe"}
# The HF classes whose attention honours config.json's sliding_window (Llama's ignores it).
_WINDOWED = {"MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM", "Phi3ForCausalLM",
             "MixtralForCausalLM", "Qwen3MoeForCausalLM"}


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
        # Memory-mapped views, not reads (loader/mapped_safetensors.py): each tensor is converted or used in
        # place from the file's pages, one at a time.
        for file in files:
            try:
                yield from mapped_tensors(file)
            except (ValueError, OSError, KeyError, TypeError, RuntimeError) as exc:
                raise ModelLoadError(f"corrupt safetensors file {file.name}: {exc}") from exc

    names = []
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                names += list(f.keys())
        except Exception as exc:
            raise ModelLoadError(f"corrupt safetensors file {file.name}: {exc}") from exc
    quantization = raw.get("quantization_config") or _quantize_config(path)
    if quantization is not None and not isinstance(quantization, dict):
        raise ModelLoadError(f"{path / 'config.json'}: quantization_config must be an object")
    return Checkpoint(path, config, Tokenizer.from_hf_dir(path), len(names), weights,
                      quantization_config=quantization, tensor_names=lambda: names,
                      tensor_sizes=lambda: _tensor_sizes(files))


def _tensor_sizes(files: list[Path]) -> list[tuple[int, int, bool]]:
    """(elements, bytes, stored quantized) of every tensor, from the safetensors headers (no data read)."""
    import struct

    sizes = []
    for file in files:
        with open(file, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            elements = 1
            for dim in entry["shape"]:
                elements *= int(dim)
            start, end = entry["data_offsets"]
            sizes.append((elements, int(end) - int(start), not entry["dtype"].startswith(("F", "BF"))
                          or entry["dtype"].startswith("F8")))
    return sizes


def _quantize_config(path: Path) -> dict | None:
    """Older AutoGPTQ checkpoints keep their quantization in quantize_config.json (without quant_method)."""
    file = path / "quantize_config.json"
    if not file.is_file():
        return None
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {file}: {exc}") from exc
    return {"quant_method": "gptq", **config} if isinstance(config, dict) else config


def model_config_from_hf(raw: dict) -> ModelConfig:
    arch_names = raw.get("architectures") or []
    hf_class = next((a for a in arch_names if a in _HF_ARCHITECTURES), None)
    if hf_class is None:
        raise ModelLoadError(f"unsupported architecture {arch_names}; supported: {', '.join(_HF_ARCHITECTURES)}")
    arch = _HF_ARCHITECTURES[hf_class]
    try:
        heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        rope = raw.get("rope_scaling") or raw.get("rope_parameters")
        rope_theta = raw.get("rope_theta") or (rope or {}).get("rope_theta", 10000.0)
        partial_rotary = raw.get("partial_rotary_factor") or (rope or {}).get("partial_rotary_factor") or 1.0
        if rope and rope.get("rope_type", rope.get("type")) in (None, "default"):
            rope = None
        if rope and rope.get("rope_type", rope.get("type")) in ("longrope", "su"):  # "su": older Phi-3 configs
            rope = _longrope(raw, rope)
        return ModelConfig(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", arch == "gemma2")),
            attention_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
            rotary_dim=int(head_dim * partial_rotary) if partial_rotary != 1.0 else None,
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "silu",
            **_sliding_window(hf_class, raw),
            **(_gemma2(raw) if arch == "gemma2" else {}),
            **(_experts(arch, raw) if arch in ("mixtral", "qwen3_moe") else {}),
        )
    except KeyError as exc:
        raise ModelLoadError(f"config.json lacks {exc}") from exc


def _sliding_window(hf_class: str, raw: dict) -> dict:
    """Which layers see a sliding window, the way each HF class reads its config."""
    window = raw.get("sliding_window")
    if hf_class not in _WINDOWED or not window or raw.get("use_sliding_window") is False:  # Qwen's switch
        return {}
    layers = raw["num_hidden_layers"]
    if raw.get("layer_types") and hf_class in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM"):
        sliding = tuple(t == "sliding_attention" for t in raw["layer_types"])
    elif hf_class == "Gemma2ForCausalLM":  # configs written before layer_types: every other layer, from the first
        sliding = tuple(i % 2 == 0 for i in range(layers))
    elif hf_class in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        sliding = tuple(i >= raw.get("max_window_layers", layers) for i in range(layers))
    else:
        sliding = None  # every layer
    return dict(sliding_window=int(window), sliding_layers=sliding)


def _gemma2(raw: dict) -> dict:
    return dict(norm_weight_offset=1.0, sandwich_norms=True, embedding_scale=raw["hidden_size"] ** 0.5,
                attn_scale=raw.get("query_pre_attn_scalar", 256) ** -0.5,
                attn_softcap=raw.get("attn_logit_softcapping"), final_softcap=raw.get("final_logit_softcapping"))


def _experts(arch: str, raw: dict) -> dict:
    layers = raw["num_hidden_layers"]
    if arch == "mixtral":  # every layer sparse, experts as wide as the config's MLP, always renormalised
        return dict(num_experts=raw["num_local_experts"], num_experts_per_tok=raw["num_experts_per_tok"],
                    moe_intermediate_size=raw["intermediate_size"], norm_topk_prob=True)
    step = raw.get("decoder_sparse_step", 1)
    dense = set(raw.get("mlp_only_layers") or []) | {i for i in range(layers) if (i + 1) % step}
    return dict(num_experts=raw.get("num_experts") or raw["num_local_experts"],
                num_experts_per_tok=raw["num_experts_per_tok"], moe_intermediate_size=raw["moe_intermediate_size"],
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)), dense_layers=tuple(sorted(dense)))


def _longrope(raw: dict, rope: dict) -> dict:
    """Phi-3's rope dict, completed the way HF completes it: the pretraining length (config.json's top-level
    value first) and the extension factor it implies."""
    rope = dict(rope, rope_type="longrope")
    original = raw.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
    rope["original_max_position_embeddings"] = original or raw["max_position_embeddings"]
    if rope.get("factor") is None:
        rope["factor"] = raw["max_position_embeddings"] / rope["original_max_position_embeddings"]
    return rope
