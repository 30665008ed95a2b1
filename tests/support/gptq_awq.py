"""GPTQ and AutoAWQ GEMM weights packed with numpy from the formats' published layouts: min-max
quantization, the packers, and a state dict's linears replaced by their packed tensors.

One home for the tests' writers (support/quantized_dirs.py, support/quantized_moe_dirs.py), the
quantized-checkpoint tests and bench/packed_checkpoints.py; it imports no other support module, so
the bench reads it as tests.support.gptq_awq.
"""
from __future__ import annotations

import numpy as np
import torch

AWQ_SLOTS = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM: slot i of a word holds column AWQ_SLOTS[i] of its eight


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
    random order): consecutive columns of that order form the groups. A scale of 0 (a group of zeros)
    divides as 1e-8, so q = zero; any other fp16 scale is at least 6e-8 and divides as itself."""
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
            z = np.clip(np.round(-lo / np.maximum(s.astype(np.float32), 1e-8)), 0, top).astype(np.int64)
        s32 = np.maximum(s.astype(np.float32), 1e-8)
        q[:, cols] = np.clip(np.round(block / s32[:, None]) + z[:, None], 0, top)
        zeros[:, g], scales[:, g] = z, s
    return q, zeros, scales, g_idx


def np_dequantize(q, zeros, scales, g_idx) -> np.ndarray:
    return ((q - zeros[:, g_idx]) * scales.astype(np.float32)[:, g_idx]).astype(np.float32)


def act_orders(widths: dict[str, int], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A random act-order for each linear (name -> in_features, in the model's order: one permutation
    drawn per linear), shared by the linears that read the same input (q/k/v, gate/up) as GPTQ's is."""
    orders: dict[str, np.ndarray] = {}
    return {name: orders.setdefault(name.replace("k_proj", "q_proj").replace("v_proj", "q_proj")
                                    .replace("up_proj", "gate_proj"), rng.permutation(k))
            for name, k in widths.items()}


def pack_linears(state: dict[str, torch.Tensor], linears: dict[str, np.ndarray | None], method: str, bits: int,
                 group: int, sym: bool) -> dict[str, torch.Tensor]:
    """Replace `<name>.weight` in `state` for each name of `linears` (name -> its act-order, or None) by
    GPTQ's tensors ("gptq": AutoGPTQ's v1 format, qzeros holding zero - 1) or AutoAWQ GEMM's ("awq",
    4-bit); returns each weight as a reader of those tensors dequantizes it, float32 by weight name."""
    dequantized, mask = {}, (1 << bits) - 1
    for name, order in linears.items():
        q, zeros, scales, g_idx = np_quantize(state.pop(f"{name}.weight").float().numpy(), bits, group, sym,
                                              order=order)
        if method == "gptq":
            stored = (zeros - 1) & mask
            zeros = stored + 1  # what AutoGPTQ's own dequantizer reads back
            packed = {"qweight": np_pack_rows(q.T, bits), "qzeros": np_pack_columns(stored.T, bits),
                      "scales": scales.T, "g_idx": g_idx.astype(np.int32)}
        else:
            packed = {"qweight": np_pack_columns(q.T, 4, AWQ_SLOTS), "qzeros": np_pack_columns(zeros.T, 4, AWQ_SLOTS),
                      "scales": scales.T}
        state.update({f"{name}.{k}": torch.from_numpy(np.ascontiguousarray(v)) for k, v in packed.items()})
        dequantized[f"{name}.weight"] = torch.from_numpy(np_dequantize(q, zeros, scales, g_idx))
    return dequantized


def quantization_config(method: str, bits: int, group: int, sym: bool, act_order: bool = False) -> dict:
    """config.json's quantization_config for pack_linears' tensors."""
    if method == "gptq":
        return dict(quant_method="gptq", bits=bits, group_size=group, desc_act=act_order, sym=sym,
                    checkpoint_format="gptq")
    return dict(quant_method="awq", bits=4, group_size=group, version="gemm", zero_point=True)
