"""Tiny quantized HF directories for the checkpoint-format tests.

compressed-tensors directories are written by the compressed-tensors package itself (the library
llm-compressor saves with): its scheme applied to a tiny random Llama, the weight scales set from
each group's range (what llm-compressor's min-max observer computes), then its ModelCompressor.
GPTQ and AWQ directories are packed here with numpy, from the formats' published layouts.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from support.hf_dirs import write_hf_dir

SHAPE = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
             tie_word_embeddings=False)


def tiny_llama(seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).eval()


def write_compressed_tensors(path: Path, gguf_path, weights: dict, fmt: str, seed: int = 0) -> None:
    """A tiny Llama quantized by compressed-tensors with weight arguments `weights` (QuantizationArgs
    fields), lm_head ignored, saved in format `fmt` (pack-quantized, int-quantized, float-quantized)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = tiny_llama(seed)
    write_hf_dir(model, path, gguf_path, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    args = QuantizationArgs(**weights)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=["lm_head"], format=fmt)
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "weight_scale", None) is None:
                continue
            w = module.weight
            n, k = w.shape
            if args.strategy == "group":
                lo, hi = (f(w.reshape(n, k // args.group_size, -1), -1) for f in (torch.amin, torch.amax))
            elif args.strategy == "channel":
                lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
            elif args.strategy == "block":
                b0, b1 = args.block_structure
                blocks = w.reshape(n // b0, b0, k // b1, b1)
                lo, hi = blocks.amin((1, 3)), blocks.amax((1, 3))
            else:
                lo, hi = w.amin().reshape(1), w.amax().reshape(1)
            scale, zero = calculate_qparams(lo, hi, args)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if getattr(module, "weight_zero_point", None) is not None:
                module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(str(path))


def transformers_reference(path: Path):
    """transformers on the same directory, decompressed to float32 weights."""
    import transformers

    quant = transformers.CompressedTensorsConfig(run_compressed=False)
    return transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=quant,
                                                             torch_dtype=torch.float32).eval()


def greedy(model, prompt: list[int], tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=2)
    return out[0, len(prompt):].tolist()


def update_config(path: Path, **fields) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(fields)
    (path / "config.json").write_text(json.dumps(config))


def np_pack_rows(q: np.ndarray, bits: int) -> np.ndarray:
    """uint values [K, N] -> int32 [K * bits / 32, N], value i of a word at bits i * bits (GPTQ's qweight)."""
    per = 32 // bits
    words = np.zeros((q.shape[0] // per, q.shape[1]), dtype=np.uint32)
    for i in range(per):
        words |= q[i::per].astype(np.uint32) << np.uint32(i * bits)
    return words.view(np.int32)


def np_pack_columns(q: np.ndarray, bits: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """uint values [R, N] -> int32 [R, N * bits / 32] packed along N; `order`: which column of each run of
    32 / bits goes in slot i (AutoAWQ's interleave), else column i in slot i."""
    per = 32 // bits
    runs = q.reshape(q.shape[0], -1, per)
    if order is not None:
        runs = runs[:, :, list(order)]
    return np_pack_rows(runs.transpose(2, 0, 1).reshape(per, -1), bits).reshape(q.shape[0], -1)


def np_quantize(w: np.ndarray, bits: int, group: int, sym: bool, rng: np.random.Generator | None = None,
                order: np.ndarray | None = None):
    """Min-max quantization of float [N, K] in groups along K -> (q uint [N, K], zeros [N, G], scales fp16
    [N, G], g_idx [K]); act-order with `order` (the columns in the order they are quantized) or `rng` (a
    random order): consecutive columns of that order form the groups."""
    n, k = w.shape
    group = k if group == -1 else group
    g_idx = np.arange(k) // group
    if order is None and rng is not None:
        order = rng.permutation(k)
    if order is not None:
        g_idx = np.empty(k, dtype=np.int64)
        g_idx[order] = np.arange(k) // group
    q = np.zeros((n, k), dtype=np.int64)
    groups = k // group
    zeros, scales = np.zeros((n, groups), dtype=np.int64), np.zeros((n, groups), dtype=np.float16)
    top = (1 << bits) - 1
    for g in range(groups):
        cols = g_idx == g
        block = w[:, cols]
        if sym:
            s = (np.abs(block).max(1) / ((top + 1) // 2 - 0.5)).astype(np.float16)
            z = np.full(n, (top + 1) // 2)
        else:
            lo, hi = np.minimum(block.min(1), 0), np.maximum(block.max(1), 0)
            s = ((hi - lo) / top).astype(np.float16)
            z = np.clip(np.round(-lo / s.astype(np.float32)), 0, top).astype(np.int64)
        q[:, cols] = np.clip(np.round(block / s.astype(np.float32)[:, None]) + z[:, None], 0, top)
        zeros[:, g], scales[:, g] = z, s
    return q, zeros, scales, g_idx


def np_dequantize(q, zeros, scales, g_idx) -> np.ndarray:
    return ((q - zeros[:, g_idx]) * scales.astype(np.float32)[:, g_idx]).astype(np.float32)


AWQ_SLOTS = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM: slot i of a word holds column AWQ_SLOTS[i] of its eight


def write_packed_dir(path: Path, gguf_path, method: str, bits: int, group: int, sym: bool = True,
                     act_order: bool = False, seed: int = 0):
    """A tiny Llama as a GPTQ ("gptq", AutoGPTQ's v1 format with its zero - 1) or AutoAWQ GEMM ("awq")
    directory; returns the transformers model holding the dequantized float weights (the reference)."""
    from safetensors.torch import load_file, save_file

    model = tiny_llama(seed)
    write_hf_dir(model, path, gguf_path, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    rng = np.random.default_rng(seed)
    state = load_file(path / "model.safetensors")
    mask = (1 << bits) - 1
    orders: dict[str, np.ndarray] = {}  # act-order: layers that read the same input (q/k/v, gate/up) share it
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name == "lm_head":
            continue
        reader = name.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
        order = orders.setdefault(reader, rng.permutation(module.in_features)) if act_order else None
        q, zeros, scales, g_idx = np_quantize(module.weight.detach().numpy(), bits, group, sym, order=order)
        del state[f"{name}.weight"]
        if method == "gptq":
            stored = (zeros - 1) & mask
            zeros = stored + 1  # what AutoGPTQ's own dequantizer reads back
            packed = {"qweight": np_pack_rows(q.T, bits), "qzeros": np_pack_columns(stored.T, bits),
                      "scales": scales.T, "g_idx": g_idx.astype(np.int32)}
        else:
            packed = {"qweight": np_pack_columns(q.T, 4, AWQ_SLOTS), "qzeros": np_pack_columns(zeros.T, 4, AWQ_SLOTS),
                      "scales": scales.T}
        state.update({f"{name}.{k}": torch.from_numpy(np.ascontiguousarray(v)) for k, v in packed.items()})
        with torch.no_grad():
            module.weight.copy_(torch.from_numpy(np_dequantize(q, zeros, scales, g_idx)))
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    if method == "gptq":
        config = dict(quant_method="gptq", bits=bits, group_size=group, desc_act=act_order, sym=sym,
                      checkpoint_format="gptq")
    else:
        config = dict(quant_method="awq", bits=4, group_size=group, version="gemm", zero_point=True)
    update_config(path, quantization_config=config)
    return model
