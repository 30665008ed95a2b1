"""SmolLM2 (the bundled Q4_1 GGUF, dequantized) as GPTQ and AutoAWQ GEMM directories and as other GGUF
types, for bench/format_perplexity.py.

GPTQ (AutoGPTQ's v1 layout: qzeros hold zero - 1) and AutoAWQ GEMM (columns interleaved 0 2 4 6 1 3 5 7
in each word) are packed here with numpy from the formats' published layouts, by round-to-nearest
min-max quantization; act-order permutes each layer's input columns (shared by the layers that read
the same input, as GPTQ's order is) and records each column's group in g_idx. The writer returns the
float weights it quantized to (its own dequantization, independent of kaon's loader) for the reference.
"""
from __future__ import annotations

import ctypes
import json
from pathlib import Path

import numpy as np
import torch

MODEL = "builtin://smollm2-135m-instruct"
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_SLOTS = (0, 2, 4, 6, 1, 3, 5, 7)  # slot i of an AutoAWQ GEMM word holds column AWQ_SLOTS[i] of its eight


def pack_rows(q: np.ndarray, bits: int) -> np.ndarray:
    """uint values [R, C] -> int32 [R * bits / 32, C], value i of a word at bits i * bits."""
    per = 32 // bits
    words = np.zeros((q.shape[0] // per, q.shape[1]), dtype=np.uint32)
    for i in range(per):
        words |= q[i::per].astype(np.uint32) << np.uint32(i * bits)
    return words.view(np.int32)


def pack_columns(q: np.ndarray, bits: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """uint values [R, C] -> int32 [R, C * bits / 32] packed along C, slot i of a run holding column order[i]."""
    per = 32 // bits
    runs = q.reshape(q.shape[0], -1, per)
    runs = runs[:, :, list(order)] if order is not None else runs
    return pack_rows(runs.transpose(2, 0, 1).reshape(per, -1), bits).reshape(q.shape[0], -1)


def quantize(w: np.ndarray, bits: int, group: int, sym: bool, order: np.ndarray | None):
    """float [N, K] -> (q [N, K], zeros [N, G], scales fp16 [N, G], g_idx [K]); with `order`, consecutive
    columns of that order form the groups (act-order)."""
    n, k = w.shape
    g_idx = np.arange(k) // group
    if order is not None:
        g_idx = np.empty(k, dtype=np.int64)
        g_idx[order] = np.arange(k) // group
    top = (1 << bits) - 1
    q = np.zeros((n, k), dtype=np.int64)
    zeros, scales = np.zeros((n, k // group), dtype=np.int64), np.zeros((n, k // group), dtype=np.float16)
    for g in range(k // group):
        cols = g_idx == g
        block = w[:, cols]
        if sym:
            s = (np.abs(block).max(1) / ((top + 1) // 2 - 0.5)).astype(np.float16)
            z = np.full(n, (top + 1) // 2)
        else:
            lo, hi = np.minimum(block.min(1), 0), np.maximum(block.max(1), 0)
            s = ((hi - lo) / top).astype(np.float16)
            z = np.clip(np.round(-lo / np.maximum(s.astype(np.float32), 1e-8)), 0, top).astype(np.int64)
        s32 = np.maximum(s.astype(np.float32), 1e-8)
        q[:, cols] = np.clip(np.round(block / s32[:, None]) + z[:, None], 0, top)
        zeros[:, g], scales[:, g] = z, s
    return q, zeros, scales, g_idx


def write_packed(directory: Path, method: str, bits: int, group: int, sym: bool,
                 act_order: bool = False) -> dict[str, torch.Tensor]:
    """The model as a "gptq" or "awq" directory; returns each quantized linear's float weight as written."""
    from safetensors.torch import save_file

    from kaon_runtime.loader import open_checkpoint

    checkpoint = open_checkpoint(MODEL)
    c, rng = checkpoint.config, np.random.default_rng(0)
    state, floats, orders = {}, {}, {}
    mask = (1 << bits) - 1
    for name, tensor in checkpoint.weights():
        module, _, kind = name.rpartition(".")
        if module.rpartition(".")[2] not in LINEARS or kind != "weight":
            state[name] = tensor.contiguous()
            continue
        w = tensor.float().numpy()
        reader = module.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
        order = orders.setdefault(reader, rng.permutation(w.shape[1])) if act_order else None
        q, zeros, scales, g_idx = quantize(w, bits, group, sym, order)
        if method == "gptq":
            stored = (zeros - 1) & mask
            zeros = stored + 1  # what AutoGPTQ's v1 dequantizer reads back
            packed = {"qweight": pack_rows(q.T, bits), "qzeros": pack_columns(stored.T, bits),
                      "scales": scales.T, "g_idx": g_idx.astype(np.int32)}
        else:
            packed = {"qweight": pack_columns(q.T, 4, AWQ_SLOTS), "qzeros": pack_columns(zeros.T, 4, AWQ_SLOTS),
                      "scales": scales.T}
        state.update({f"{module}.{k}": torch.from_numpy(np.ascontiguousarray(v)) for k, v in packed.items()})
        floats[name] = torch.from_numpy((q - zeros[:, g_idx]) * scales.astype(np.float32)[:, g_idx]).float()
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    quant = (dict(quant_method="gptq", bits=bits, group_size=group, desc_act=act_order, sym=sym,
                  checkpoint_format="gptq") if method == "gptq" else
             dict(quant_method="awq", bits=4, group_size=group, version="gemm", zero_point=True))
    config = dict(architectures=["LlamaForCausalLM"], vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                  intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
                  num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                  max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                  rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings, quantization_config=quant)
    (directory / "config.json").write_text(json.dumps(config))
    tokenizer = checkpoint.tokenizer
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": tokenizer.backend.id_to_token(tokenizer.bos_token_id) if tokenizer.bos_token_id is not None
        else None, "eos_token": tokenizer.backend.id_to_token(tokenizer.eos_token_ids[0])}))
    return floats


def quantized_gguf(type_name: str, directory: Path) -> Path:
    """The bundled GGUF requantized to `type_name` (Q6_K, Q5_0, ...) by llama.cpp's own quantizer."""
    import llama_cpp

    from kaon_runtime.loader import resolve_model

    target = directory / f"SmolLM2-135M-Instruct.{type_name}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{type_name}"), True
    if llama_cpp.llama_model_quantize(str(resolve_model(MODEL)).encode(), str(target).encode(),
                                      ctypes.byref(params)) != 0:
        raise SystemExit(f"llama.cpp could not quantize to {type_name}")
    return target
