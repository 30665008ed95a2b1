"""GGUF loading: metadata -> ModelConfig, quantized tensors dequantized to HF-named weights.

Q4_1 tensors are also offered as their raw blocks, which int4 quantization takes as they are.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from kaon_runtime.config import ModelConfig
from kaon_runtime.errors import ModelLoadError
from kaon_runtime.loader.checkpoint import Checkpoint
from kaon_runtime.loader.tokenizer import Tokenizer

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")  # GGUF files (general.architecture) kaon reads
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def load_gguf(path: Path) -> Checkpoint:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        fields = {name: _field_value(field) for name, field in reader.fields.items()}
    except Exception as exc:  # the reader raises whatever numpy hits on a broken file
        raise ModelLoadError(f"{path.name} is not a valid GGUF file: {exc}") from exc
    config = model_config_from_gguf(fields, reader.tensors)
    tokenizer = Tokenizer.from_gguf_fields(fields)

    def hf_rows(name: str, rows: torch.Tensor) -> torch.Tensor:
        if config.architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            return unpermute_qk(rows, config.num_heads if "q_proj" in name else config.num_kv_heads)
        return rows

    def weights():
        for tensor in reader.tensors:
            name = hf_name(tensor.name)
            try:
                array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            except Exception as exc:
                raise ModelLoadError(f"cannot dequantize {tensor.name} in {path.name}: {exc}") from exc
            # A copy: the file is memory-mapped read-only.
            yield name, hf_rows(name, torch.from_numpy(np.array(array, dtype=np.float32)))

    q4_1 = gguf.GGMLQuantizationType.Q4_1
    block_bytes = gguf.GGML_QUANT_SIZES[q4_1][1]

    def q4_1_blocks():
        for tensor in reader.tensors:
            if tensor.tensor_type == q4_1:
                name = hf_name(tensor.name)
                blocks = torch.from_numpy(np.array(tensor.data)).view(tensor.data.shape[0], -1, block_bytes)
                yield name, hf_rows(name, blocks)  # Q/K rows move whole: a block never spans two rows

    has_q4_1 = any(t.tensor_type == q4_1 for t in reader.tensors)
    return Checkpoint(path, config, tokenizer, len(reader.tensors), weights, q4_1_blocks if has_q4_1 else None)


def model_config_from_gguf(fields: dict, tensors) -> ModelConfig:
    arch = fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r}; supported: {SUPPORTED_ARCHITECTURES}")
    names = {t.name for t in tensors}
    if "rope_freqs.weight" in names:
        raise ModelLoadError("GGUF files with rope_freqs (Llama 3.1 scaling) are not supported yet; "
                             "load the model's HF directory instead")

    def get(key, default=None):
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
        return value

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(fields.get(f"{arch}.vocab_size") or len(fields["tokenizer.ggml.tokens"])),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(fields.get(f"{arch}.attention.key_length") or hidden // heads),
        max_position_embeddings=int(get("context_length")),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
    )


def hf_name(gguf_name: str) -> str:
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{kind}"
    match = _LAYER_NAME.match(gguf_name)
    if match is None or match.group(2) not in _LAYER_TENSORS:
        raise ModelLoadError(f"unexpected tensor {gguf_name!r} in GGUF file")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{kind}"


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of Q/K (interleaved rotary pairs -> HF's split halves).

    llama.cpp stores each head's rows as (pair, 2) so rotary pairs are adjacent; HF keeps
    the two halves of a head apart. Swapping the two middle axes back restores HF's layout.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape).contiguous()


def _field_value(field):
    try:
        return field.contents()
    except Exception:  # noqa: BLE001  a field type gguf cannot decode is left out, not fatal
        return None
