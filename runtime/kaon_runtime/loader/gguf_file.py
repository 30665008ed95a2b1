"""GGUF loading: metadata -> ModelConfig, quantized tensors dequantized to HF-named weights.

The layers' quantized tensors are also offered as their raw blocks (GgufCheckpoint.quantized_blocks),
which the engine keeps quantized (quant/gguf.py repacks them into kaon's layouts).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kaon_runtime.config import ModelConfig
from kaon_runtime.errors import ModelLoadError
from kaon_runtime.loader.checkpoint import Checkpoint
from kaon_runtime.loader.tokenizer import Tokenizer

# GGUF files (general.architecture) kaon reads. Not yet: gemma2 (llama.cpp stores its norms with
# the +1 folded in, and its soft-capping and windows in metadata), phi3 (fused qkv and gate|up,
# LongRoPE factor tensors), mixtral and qwen3moe (experts merged into 3-D tensors).
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",  # Qwen3
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


# GGML types that are not quantized blocks: the float ones, read as floats.
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


@dataclass(slots=True)
class GgufCheckpoint(Checkpoint):
    """A GGUF file's checkpoint: also the raw blocks of its layers' quantized tensors, each as
    (HF name, GGML type name, uint8 [rows, bytes per row]), rows in HF order."""

    quantized_blocks: Callable[[], Iterator[tuple[str, str, torch.Tensor]]] | None = None
    quantized_types: frozenset[str] = frozenset()  # their GGML type names


def load_gguf(path: Path) -> Checkpoint:
    import gguf

    try:
        reader = _checked_reader(gguf)(str(path))
        fields = {name: _field_value(field) for name, field in reader.fields.items()}
    except ModelLoadError as exc:
        raise ModelLoadError(f"{exc} in {path.name}") from exc
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
                raise ModelLoadError(f"cannot dequantize {tensor.name} ({tensor.tensor_type.name}) in "
                                     f"{path.name}: {exc}") from exc
            # A copy: the file is memory-mapped read-only.
            yield name, hf_rows(name, torch.from_numpy(np.array(array, dtype=np.float32)))

    quantized = [t for t in reader.tensors if t.name.startswith("blk.") and t.tensor_type.name not in FLOAT_TYPES
                 and len(t.shape) == 2]

    def quantized_blocks():
        for tensor in quantized:
            name = hf_name(tensor.name)
            rows = torch.from_numpy(np.array(tensor.data)).view(tensor.data.shape[0], -1)
            yield name, tensor.tensor_type.name, hf_rows(name, rows)  # Q/K rows move whole: blocks never span rows

    return GgufCheckpoint(path, config, tokenizer, len(reader.tensors), weights,
                          quantized_blocks=quantized_blocks if quantized else None,
                          quantized_types=frozenset(t.tensor_type.name for t in quantized))


def _checked_reader(gguf):
    """gguf's reader, refusing a tensor of a type it does not know or that the file ends inside of
    by the tensor's name (gguf's own errors name neither)."""

    class CheckedReader(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):
            for field in fields:
                _, name_data, _, dims, raw_type, offset = field.parts
                name = bytes(name_data).decode("utf-8", "replace")
                try:
                    ggml_type = gguf.GGMLQuantizationType(int(raw_type[0]))
                except ValueError:
                    raise ModelLoadError(f"tensor {name} has an unknown GGML type {int(raw_type[0])}") from None
                block, size = gguf.GGML_QUANT_SIZES[ggml_type]
                end = start_offs + int(offset[0]) + int(np.prod(dims)) * size // block
                if end > len(self.data):
                    raise ModelLoadError(f"tensor {name} is truncated: the file ends {end - len(self.data)} bytes "
                                         "before it does")
            super()._build_tensors(start_offs, fields)

    return CheckedReader


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
        qk_norm="blk.0.attn_q_norm.weight" in names,
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
