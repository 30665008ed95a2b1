"""Decode-only steps of a plain Llama-family decoder on CPU, through the fused C step.

Steps whose every token is a decode (one new token per sequence) run all layers in one call
of kernels/cpu_decode.c; in a step with prefill chunks or drafts the decodes do, and the chunks
take the torch path (split_decodes). The fused
step covers what Llama, SmolLM2, Mistral and Qwen2 need (full attention, SwiGLU, plain
RMSNorm, biases); the other options of the shared decoder keep torch (`unsupported`).
"""
from __future__ import annotations

import ctypes
from dataclasses import replace

import torch
from torch import nn

from kaon_runtime.config import ModelConfig
from kaon_runtime.kernels import cpu_decode
from kaon_runtime.layers.attention import AttentionMetadata


def split_decodes(meta: AttentionMetadata) -> tuple[AttentionMetadata, AttentionMetadata]:
    """A mixed step's metadata as two: its decodes (the first rows) and its prefill chunks, whose
    rows then start at 0."""
    n = meta.num_decode_tokens
    decodes = AttentionMetadata(slot_mapping=meta.slot_mapping[:n], num_decode_tokens=n,
                                decode_block_tables=meta.decode_block_tables,
                                decode_context_lens=meta.decode_context_lens)
    prefills = AttentionMetadata(slot_mapping=meta.slot_mapping[n:],
                                 prefills=[replace(c, query_start=c.query_start - n) for c in meta.prefills])
    return decodes, prefills


def unsupported(config: ModelConfig) -> str | None:
    """Why the fused step cannot run this model, or None when it can."""
    reasons = [
        (config.qk_norm, "q/k norms"),
        (config.sandwich_norms or config.norm_weight_offset != 0, "Gemma's norms"),
        (config.hidden_act != "silu", f"the {config.hidden_act} activation"),
        (config.rotary_dim not in (None, config.head_dim), "partial rotary"),
        (any(config.window(i) is not None for i in range(config.num_layers)), "sliding windows"),
        (config.attn_softcap is not None, "attention soft-capping"),
        (config.num_experts > 0, "experts"),
        (config.hidden_size % cpu_decode.QBLOCK or config.intermediate_size % cpu_decode.QBLOCK,
         f"widths that are not multiples of {cpu_decode.QBLOCK}"),
    ]
    found = [reason for applies, reason in reasons if applies]
    return ", ".join(found) or None


# The most sequences a step may have to take the C kernels: a full batch (int4 at 64 sequences:
# 253 against 196 tok/s through torch on the 2-vCPU test machine; float32's register-tiled
# kernel is on a par with torch's BLAS for the projections there and saves the torch ops).
# The vocabulary head takes the same kernels for as many rows (the float one in its [K, N]
# layout: 64 rows in ~24 ms against ~35 through torch's BLAS, which packs the whole weight).
MAX_ROWS = 64
KV_DTYPES = (torch.float32, torch.float16)  # the caches the C step reads


def linear_weights(module: nn.Module) -> cpu_decode.LinearWeights:
    """A projection as the C step reads it: float32 nn.Linear, kaon's int8 or its int4 (groups of 32)."""
    bias = getattr(module, "bias", None)
    if type(module) is nn.Linear:
        return cpu_decode.LinearWeights.f32(module.weight, bias)
    qweight = getattr(module, "qweight", None)
    if qweight is not None and qweight.dtype == torch.int8:
        return cpu_decode.LinearWeights.int8(qweight, module.scales, bias)
    if getattr(module, "group_size", None) == cpu_decode.QBLOCK and hasattr(module, "packed"):
        return cpu_decode.LinearWeights.q4_1(module.packed, module.scales, module.mins, bias)
    raise ValueError(f"no fused CPU kernel for {type(module).__name__}")


def head_weights(head: nn.Module) -> cpu_decode.LinearWeights | None:
    """The vocabulary head for the C kernel (its int8 copy under quantization, else the float
    one), for up to MAX_ROWS rows like the step."""
    if head.quantized is not None:
        qweight = getattr(head.quantized, "qweight", None)
        if qweight is None or qweight.dtype != torch.int8:
            return None
        return cpu_decode.LinearWeights.int8(qweight, head.quantized.scales)
    return cpu_decode.LinearWeights.f32_t(head.weight_t)


class CpuDecodeStep:
    """Holds the C structs that point at the model's weights and KV pool (built on first use:
    the pool is attached after the model is made)."""

    def __init__(self, decoder: nn.Module, config: ModelConfig):
        self.decoder, self.config = decoder, config
        self._built: tuple[int, cpu_decode.Model, list] | None = None
        self.max_rows = MAX_ROWS

    def check(self) -> None:
        """Raise ValueError if a projection has no fused kernel; call once before enabling."""
        for layer in self.decoder.layers:
            for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                           layer.mlp.down_proj):
                linear_weights(module)

    def _model(self) -> cpu_decode.Model:
        first_cache = self.decoder.layers[0].self_attn.attn.k_cache
        if self._built is not None and self._built[0] == first_cache.data_ptr():
            return self._built[1]
        c, layers, keep = self.config, self.decoder.layers, []
        structs = (cpu_decode.Layer * len(layers))()
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            linears = [linear_weights(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            norms = [layer.input_layernorm.weight.detach().float().contiguous(),
                     layer.post_attention_layernorm.weight.detach().float().contiguous()]
            keep += linears + norms
            structs[i] = cpu_decode.Layer(*(w.struct for w in linears), *(n.data_ptr() for n in norms),
                                          attn.attn.k_cache.data_ptr(), attn.attn.v_cache.data_ptr())
        cos, sin = self.decoder.rotary.tables(torch.device("cpu"))
        final_norm = self.decoder.norm.weight.detach().float().contiguous()
        keep += [structs, cos, sin, final_norm]
        kv_heads, num_blocks, block_size, _ = first_cache.shape
        if block_size & (block_size - 1):
            raise ValueError(f"the fused step needs a power-of-two block size, got {block_size}")
        if first_cache.dtype not in KV_DTYPES:
            raise ValueError(f"the fused step reads a float32 or float16 KV cache, not {first_cache.dtype}")
        model = cpu_decode.Model(
            num_layers=len(layers), hidden=c.hidden_size, num_heads=c.num_heads, num_kv_heads=kv_heads,
            head_dim=c.head_dim, intermediate=c.intermediate_size, block_size=block_size, num_blocks=num_blocks,
            kv_half=first_cache.dtype == torch.float16,
            eps=c.rms_norm_eps, scale=layers[0].self_attn.attn.scale, final_norm=final_norm.data_ptr(),
            cos=cos.data_ptr(), sin=sin.data_ptr(), layers=ctypes.cast(structs, ctypes.POINTER(cpu_decode.Layer)))
        self._built = (first_cache.data_ptr(), model, keep)
        return model

    def applies(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        return not meta.prefills and self.max_rows >= meta.num_decode_tokens == x.shape[0] > 0

    def applies_to_decodes_of(self, meta: AttentionMetadata) -> bool:
        """A mixed step whose decodes the C step can take on their own (see split_decodes)."""
        return bool(meta.prefills) and 0 < meta.num_decode_tokens <= self.max_rows

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = x.float().clone(memory_format=torch.contiguous_format)  # written in place by the C step
        return cpu_decode.decode(self._model(), hidden, positions.contiguous(), meta.slot_mapping.contiguous(),
                                 meta.decode_block_tables.contiguous(), meta.decode_context_lens.contiguous())
