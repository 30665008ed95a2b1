"""Each GGUF family as llama.cpp's convert_hf_to_gguf writes it: its metadata as a ModelConfig, and its
tensors under the HF names the decoder loads.

What differs from family to family (llama.cpp's conventions):
- llama (also Mistral, and Mixtral: llama with `expert_count`): Q/K rows permuted for interleaved rotary.
- gemma2: RMSNorm weights stored with Gemma's +1 folded in (read as they are, offset 0); norms named
  post_attention_norm / ffn_norm / post_ffw_norm; soft-caps and the window in metadata; every other layer
  windowed from the first; the softmax scale from the head size (hidden / heads for the 46-layer 27B).
- phi3: q|k|v fused in attn_qkv and gate|up in ffn_up (split here, rows only); LongRoPE factors as the
  rope_factors_long / rope_factors_short tensors; rope.dimension_count for partial rotary.
- qwen3moe and Mixtral: experts stacked in 3-D ffn_gate_exps / ffn_up_exps / ffn_down_exps [E, rows, K],
  split here into per-expert HF names; the router is ffn_gate_inp.
Every transformation moves whole rows, so it applies as well to a quantized tensor's rows of blocks.
"""
from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch

from kaon_runtime.config import ModelConfig
from kaon_runtime.errors import ModelLoadError

# general.architecture -> kaon's (llama becomes mixtral when it has experts)
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "phi3": "phi3",
                 "qwen3moe": "qwen3_moe"}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",  # Qwen3
    "ffn_gate_inp": "mlp.gate", "attn_qkv": "self_attn.qkv_proj",  # MoE router; Phi-3's fused q|k|v
}
_FAMILY_TENSORS = {
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
}
_EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # read into the config, not weights
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def model_config(fields: dict, tensors) -> ModelConfig:
    """The ModelConfig of a GGUF file's metadata and tensor list (gguf's ReaderTensors)."""
    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    by_name = {t.name: t for t in tensors}
    if "rope_freqs.weight" in by_name:
        raise ModelLoadError("GGUF files with rope_freqs (Llama 3.1 scaling) are not supported yet; "
                             "load the model's HF directory instead")

    def get(key, default=None):
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
        return value

    heads, hidden, layers = int(get("attention.head_count")), int(get("embedding_length")), int(get("block_count"))
    head_dim = int(fields.get(f"{arch}.attention.key_length") or hidden // heads)
    experts = int(fields.get(f"{arch}.expert_count") or 0)
    options: dict = {}
    if experts:
        width = int(fields.get(f"{arch}.expert_feed_forward_length") or get("feed_forward_length"))
        dense = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in by_name)
        options.update(num_experts=experts, num_experts_per_tok=int(get("expert_used_count")),
                       moe_intermediate_size=width, dense_layers=dense,
                       norm_topk_prob=bool(fields.get(f"{arch}.expert_weights_norm", True)))  # llama.cpp: True
    window = fields.get(f"{arch}.attention.sliding_window")
    if arch == "gemma2":
        # llama.cpp: the 27B (46 layers) scales queries by hidden / heads, the others by the head size
        scalar = hidden // heads if layers == 46 else head_dim
        options.update(hidden_act="gelu_pytorch_tanh", sandwich_norms=True, embedding_scale=hidden ** 0.5,
                       attn_scale=scalar ** -0.5, attn_softcap=_float(fields, "gemma2.attn_logit_softcapping"),
                       final_softcap=_float(fields, "gemma2.final_logit_softcapping"))
        if window:
            options.update(sliding_window=int(window), sliding_layers=tuple(i % 2 == 0 for i in range(layers)))
    if arch == "phi3":
        rotary = int(fields.get("phi3.rope.dimension_count") or head_dim)
        options.update(rotary_dim=rotary if rotary != head_dim else None, rope_scaling=_longrope(fields, by_name))
        if window:
            options.update(sliding_window=int(window))
    return ModelConfig(
        architecture="mixtral" if arch == "llama" and experts else ARCHITECTURES[arch],
        vocab_size=int(fields.get(f"{arch}.vocab_size") or len(fields["tokenizer.ggml.tokens"])),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=int(get("context_length")),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in by_name,
        attention_bias="blk.0.attn_q.bias" in by_name,
        qk_norm="blk.0.attn_q_norm.weight" in by_name,
        **options,
    )


def hf_tensors(config: ModelConfig, gguf_name: str, rows: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The GGUF tensor `gguf_name` as HF-named tensors of the decoder; `rows` is its data with rows first
    (floats, or a quantized tensor's uint8 rows of blocks: [rows, bytes], experts [E, rows, bytes])."""
    if gguf_name in _CONFIG_TENSORS:
        return
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_TENSORS:
        yield f"{_GLOBAL_TENSORS[stem]}.{kind}", rows
        return
    match = _LAYER_NAME.match(gguf_name)
    part = match.group(2) if match else ""
    arch = config.architecture
    if match is None or part not in {**_LAYER_TENSORS, **_FAMILY_TENSORS.get(arch, {}), **_EXPERT_TENSORS}:
        raise ModelLoadError(f"unexpected tensor {gguf_name!r} in a GGUF file of architecture {arch}")
    prefix = f"model.layers.{match.group(1)}"
    if part in _EXPERT_TENSORS:
        for expert, expert_rows in enumerate(rows.unbind(0)):
            yield f"{prefix}.mlp.experts.{expert}.{_EXPERT_TENSORS[part]}.{kind}", expert_rows
        return
    name = f"{prefix}.{_FAMILY_TENSORS.get(arch, {}).get(part) or _LAYER_TENSORS[part]}.{kind}"
    if arch in ("llama", "mixtral") and part in ("attn_q", "attn_k"):
        rows = unpermute_qk(rows, config.num_heads if part == "attn_q" else config.num_kv_heads)
    if part == "attn_qkv":
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        for proj, piece in zip(("q_proj", "k_proj", "v_proj"), rows.split([q, kv, kv])):
            yield name.replace("qkv_proj", proj), piece.contiguous()
    elif name.endswith(".mlp.gate_up_proj.weight"):
        for proj, piece in zip(("gate_proj", "up_proj"), rows.chunk(2)):
            yield name.replace("gate_up_proj", proj), piece.contiguous()
    else:
        yield name, rows


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of Q/K (interleaved rotary pairs -> HF's split halves).

    llama.cpp stores each head's rows as (pair, 2) so rotary pairs are adjacent; HF keeps
    the two halves of a head apart. Swapping the two middle axes back restores HF's layout.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape).contiguous()


def _float(fields: dict, key: str) -> float | None:
    value = fields.get(key)
    return None if value is None else float(value)


def _longrope(fields: dict, by_name: dict) -> dict | None:
    """Phi-3's LongRoPE as HF's rope_scaling dict, from the factor tensors llama.cpp writes."""
    if "rope_factors_long.weight" not in by_name:
        return None
    original = int(fields.get("phi3.rope.scaling.original_context_length") or fields["phi3.context_length"])
    factors = {f"{kind}_factor": np.asarray(by_name[f"rope_factors_{kind}.weight"].data, np.float32).tolist()
               for kind in ("long", "short")}
    return {"rope_type": "longrope", **factors, "original_max_position_embeddings": original,
            "factor": int(fields["phi3.context_length"]) / original}
