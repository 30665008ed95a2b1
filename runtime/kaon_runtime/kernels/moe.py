"""Fused mixture of experts in Triton. Reference: moe_ref.moe_ref with silu_and_mul.

The (token, slot) pairs of a step are sorted by the expert they chose, and each expert's
run is padded to a whole number of BLOCK_M rows, so that one program multiplies BLOCK_M
rows by one expert's weights: a grouped GEMM that reads each expert's weights once per
block instead of once per token. Two such GEMMs (gate|up, then down with the routing
weight applied) surround the SiLU-and-mul; a sum over the k slots of each token finishes.

Nothing here waits for the device: the padded layout is sized by its upper bound
(T * k + E * (BLOCK_M - 1) rows), and blocks past the real ones return at once, so the
step can be captured in a CUDA graph.

A token's result depends on its row only (issue 49 §2): the tiles are fixed per (N, K, dtype), never
by how many tokens chose an expert, and the rows of one tl.dot are computed alike whatever the other
rows hold. With `invariant` (KAON_GPU_BATCH_INVARIANT=1) the k slots are also summed by
_sum_slots_kernel in slot order, in float32, where torch's sum picks its reduction's layout by shape.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kaon_runtime.arith import round_up
from kaon_runtime.kernels.activation import silu_and_mul

BLOCK_M = 16  # rows per program: tl.dot's minimum, and little padding when few tokens pick an expert
_TILES = {torch.float16: (64, 64), torch.bfloat16: (64, 64), torch.float32: (64, 32)}  # BLOCK_N, BLOCK_K
_SUM_BLOCK = 1024  # hidden columns per program of sum_slots


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_experts_ptr, weights_ptr, num_rows,
                         num_experts, N, K, stride_am, stride_we, stride_wn, stride_om,
                         ROWS_PER_A: tl.constexpr, MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """out[row] = a[row // ROWS_PER_A] @ w[expert].T (times weights[row]) for the BLOCK_M rows of this block.

    Rows are (token, slot) pairs numbered token * k + slot; ids >= num_rows are padding.
    """
    block, col_block = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_experts_ptr + block)
    if expert >= num_experts:  # past the last real block
        return
    rows = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < num_rows
    a_rows = rows // ROWS_PER_A
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :], mask=valid[:, None] & (ks[None, :] < K),
                    other=0.0)
        w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=(cols[None, :] < N) & (ks[:, None] < K),
                    other=0.0)  # [BLOCK_K, BLOCK_N]: the expert's rows, transposed
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + rows, mask=valid, other=0.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & (cols[None, :] < N))


@triton.jit
def _sum_slots_kernel(x_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[t] = x[t, 0] + x[t, 1] + ... + x[t, TOP_K - 1], in that order, in float32, rounded once (torch's
    sum rounds once too; only its order is left to the shape)."""
    token, col_block = tl.program_id(0), tl.program_id(1)
    cols = col_block * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    row = x_ptr + token.to(tl.int64) * (TOP_K * hidden) + cols
    acc = tl.load(row, mask=mask, other=0.0).to(tl.float32)
    for slot in tl.static_range(1, TOP_K):
        acc += tl.load(row + slot * hidden, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token.to(tl.int64) * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_slots(x: torch.Tensor) -> torch.Tensor:
    """x [T, k, H] (contiguous) -> [T, H], each token's k slots summed in slot order (_sum_slots_kernel)."""
    tokens, top_k, hidden = x.shape
    assert x.is_contiguous()
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    if tokens:
        block = min(_SUM_BLOCK, triton.next_power_of_2(hidden))
        _sum_slots_kernel[(tokens, triton.cdiv(hidden, block))](x, out, hidden, TOP_K=top_k, BLOCK=block)
    return out


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (sorted_ids, block_experts).

    sorted_ids lists the rows (token * k + slot) grouped by expert, each group padded with
    the sentinel T * k to a multiple of block_m; block_experts [len / block_m] names each
    block's expert, num_experts for the unused blocks at the end.
    """
    flat = ids.flatten()
    num_rows = flat.numel()
    order = flat.argsort(stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = round_up(counts, block_m)
    group_starts = padded.cumsum(0) - padded
    capacity = num_rows + num_experts * (block_m - 1)  # the most padding can take: no sync to learn the real size
    capacity = round_up(capacity, block_m)
    experts_in_order = flat[order]
    rank = torch.arange(num_rows, device=ids.device) - (counts.cumsum(0) - counts)[experts_in_order]
    sorted_ids = torch.full((capacity,), num_rows, dtype=torch.long, device=ids.device)
    sorted_ids[group_starts[experts_in_order] + rank] = order
    block_starts = torch.arange(0, capacity, block_m, device=ids.device)
    block_experts = torch.searchsorted(padded.cumsum(0), block_starts, right=True)  # num_experts past the end
    return sorted_ids, block_experts


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """x [T, H] through the SiLU-gated experts w13 [E, 2I, H], w2 [E, H, I] that ids [T, k] chose,
    weighted by weights [T, k] and summed per token -> [T, H] (in slot order with `invariant`)."""
    tokens, hidden = x.shape
    experts, two_i, _ = w13.shape
    top_k = ids.shape[1]
    assert x.dtype in _TILES and w13.dtype == w2.dtype == x.dtype, "float16, bfloat16 or float32 throughout"
    assert w2.shape == (experts, hidden, two_i // 2) and x.stride(1) == 1
    assert w13.is_contiguous() and w2.is_contiguous()
    if tokens == 0:
        return torch.zeros_like(x)
    sorted_ids, block_experts = align_by_expert(ids, experts)
    rows = tokens * top_k
    weights = weights.float().contiguous()
    gate_up = torch.empty(rows, two_i, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, sorted_ids, block_experts, weights, rows, top_k, mul_weight=False)
    act = silu_and_mul(gate_up)
    down = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, down, sorted_ids, block_experts, weights, rows, 1, mul_weight=True)
    down = down.view(tokens, top_k, hidden)
    return sum_slots(down) if invariant else down.sum(dim=1)


def _grouped_gemm(a, w, out, sorted_ids, block_experts, weights, rows, rows_per_a, mul_weight):
    experts, n, k = w.shape
    block_n, block_k = _TILES[a.dtype]
    block_n = min(block_n, max(16, triton.next_power_of_2(n)))
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, w, out, sorted_ids, block_experts, weights, rows, experts, n, k, a.stride(0), w.stride(0), w.stride(1),
        out.stride(0), ROWS_PER_A=rows_per_a, MUL_WEIGHT=mul_weight, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        BLOCK_K=block_k, PRECISION="ieee" if a.dtype == torch.float32 else "tf32")
