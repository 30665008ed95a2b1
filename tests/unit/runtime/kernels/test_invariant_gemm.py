"""The batch-invariant GEMMs (kernels/invariant_gemm.py) against torch, and a row's bits against its row count.

Without a GPU these run in Triton's interpreter, whose tl.dot is numpy's matmul of each tile (OpenBLAS here).
What that can prove and what it cannot:
- It can prove that nothing this module decides moves with M: the tile, the split of K, the order the
  ranges' partial sums are added in, the masking of the padding rows. Each row-invariance test below computes
  prefixes of one batch (M = 1, 5, 64, 70): a row keeps its place in its tile and its neighbours change (zeros
  when masked, other rows otherwise). A split or tile chosen by M fails them (seen: below).
- It cannot prove that a row gets the same bits at another place in the tile. numpy's matmul itself does not:
  at a fixed [64, K] x [K, 64] shape, on this Zen 2 with OpenBLAS, a row at positions 6-11 of every 12 sums
  otherwise than at position 0 (its micro-kernel's row groups), though never differently for other
  neighbours (checked 2026-11-30, numpy 2.4.6). The last test swaps in support.row_dot's dot (each row of
  a tile its own product) and shows that, given a dot whose rows do not depend on their place, the kernels
  give a row the same bits anywhere in a tile (without row_dot it fails, numpy's reason). On a GPU each
  row of a tl.dot tile is one row of the same MMA instructions; that this is place-free is what
  bench/gpu/invariant_gemm.py ("shifted 3") and engine_check.py measure at a lease.
- Nor anything about cuBLAS or the GPU's instructions: only the GPU stages measure those.

bfloat16 runs with its operands widened to float32 in the interpreter (Triton 3.9's interpreter multiplies
bfloat16 tl.dot operands as integers; the products of bfloat16 values are exact in float32), and the
interpreter truncates float32 to bfloat16 where a GPU rounds: up to one ulp against torch.
"""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

pytest.importorskip("triton")

from kaon_runtime.kernels import invariant_gemm as ig
from kaon_runtime.kernels.quant_gemm_ref import w4a16_matmul_ref, w8a16_matmul_ref
from kaon_runtime.quant.fp8 import fp8_matmul_ref, quantize_fp8
from kaon_runtime.quant.fp8_block import dequantize_fp8_blocks
from kaon_runtime.quant.int4 import quantize_int4
from kaon_runtime.quant.int8 import quantize_int8

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Relative to the output's scale: float32 sums in another order, or a half-precision result's last bit.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
PREFIXES = (1, 5, 64, 70)  # one row; a partial tile; a whole one; a second tile begun
# Small tiles so that tiny shapes still make several column tiles, K steps and ranges.
SPLIT = ig.Config(64, 32, 32, splits=3, warps=1, stages=1)
WHOLE = ig.Config(64, 32, 32, splits=1, warps=1, stages=1)


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    scale = ref.abs().max().item()
    err = (out.double() - ref.double()).abs().max().item()
    assert err <= TOLERANCE[dtype] * scale, f"{err} > {TOLERANCE[dtype]} x {scale}"


def _rows_alike(compute, x: torch.Tensor) -> None:
    """Each prefix of x's rows gives the bits the whole batch gives those rows."""
    full = compute(x)
    for m in PREFIXES:
        part = compute(x[:m])
        assert torch.equal(part, full[:m]), f"{m} rows: {(part != full[:m]).sum().item()} outputs moved"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cfg", [None, SPLIT, WHOLE], ids=["own tile", "split K", "whole K"])
def test_linear_matches_torch(dtype, cfg):
    torch.manual_seed(0)
    n, k = 72, 200  # partial column tiles and K steps
    x, w, b = (torch.randn(*s, device=DEVICE).to(dtype) for s in ((70, k), (n, k), (n,)))
    ref = F.linear(x.double(), w.double(), b.double())
    _close(ig.linear(x, w, b, cfg), ref, dtype)
    _close(ig.linear(x, w, None, cfg), ref - b.double(), dtype)


def test_linear_reads_a_transposed_table():
    """The vocabulary head stores [hidden, vocab]: its transpose is a strided [N, K] weight."""
    torch.manual_seed(1)
    table = torch.randn(96, 80, device=DEVICE)
    x = torch.randn(7, 96, device=DEVICE)
    _close(ig.linear(x, table.t(), cfg=SPLIT), x.double() @ table.double(), torch.float32)


def test_fp8_linear_matches_its_reference():
    torch.manual_seed(2)
    qweight, scales = quantize_fp8(torch.randn(72, 200))
    x = torch.randn(9, 200)
    for cfg in (SPLIT, WHOLE):
        _close(ig.fp8_linear(x.to(DEVICE), qweight.to(DEVICE), scales.to(DEVICE), cfg),
               fp8_matmul_ref(x.double(), qweight, scales.double()), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32])  # bf16 as in test_linear_matches_torch
def test_fp8_block_linear_is_the_widened_weights_product(dtype):
    """Blocks of 16 x 32 over a 72 x 200 weight (partial blocks at both edges): each weight is its e4m3 value times
    its block's scale in float32, rounded to x's dtype (Fp8BlockLinear's GPU path), then the invariant product."""
    torch.manual_seed(7)
    qweight = quantize_fp8(torch.randn(72, 200))[0].to(DEVICE)
    scales = (torch.rand(5, 7) / 50 + 1e-3).to(DEVICE)
    weight = dequantize_fp8_blocks(qweight, scales, (16, 32)).to(dtype)
    x = torch.randn(70, 200, device=DEVICE).to(dtype)
    for cfg in (SPLIT, WHOLE):
        out = ig.fp8_block_linear(x, qweight, scales, (16, 32), cfg)
        _close(out, F.linear(x.double(), weight.double()), dtype)
        if dtype == torch.float32:  # the same weights through the dense kernel: the same bits
            assert torch.equal(out, ig.linear(x, weight, cfg=cfg))
    _rows_alike(lambda rows: ig.fp8_block_linear(rows, qweight, scales, (16, 32), SPLIT), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", [None, SPLIT, WHOLE], ids=["own tile", "split K", "whole K"])
def test_linear_row_invariant(dtype, cfg):
    torch.manual_seed(3)
    w, b = torch.randn(72, 200, device=DEVICE).to(dtype), torch.randn(72, device=DEVICE).to(dtype)
    _rows_alike(lambda x: ig.linear(x, w, b, cfg), torch.randn(70, 200, device=DEVICE).to(dtype))


def test_fp8_row_invariant():
    torch.manual_seed(4)
    qweight, scales = (t.to(DEVICE) for t in quantize_fp8(torch.randn(72, 200)))
    _rows_alike(lambda x: ig.fp8_linear(x, qweight, scales, SPLIT), torch.randn(70, 200, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32])  # half types round away what a break moves
def test_w8a16_matches_reference_and_is_row_invariant(dtype):
    torch.manual_seed(5)
    qweight, scales = (t.to(DEVICE) for t in quantize_int8(torch.randn(72, 200)))
    x = torch.randn(70, 200, device=DEVICE).to(dtype)
    cfg = ig.Config(16, 32, 32, splits=3, warps=1, stages=1)
    _close(ig.w8a16_linear(x, qweight, scales, cfg), w8a16_matmul_ref(x.double(), qweight, scales), dtype)
    _close(ig.w8a16_linear(x, qweight, scales), w8a16_matmul_ref(x.double(), qweight, scales), dtype)
    _rows_alike(lambda rows: ig.w8a16_linear(rows, qweight, scales, cfg), x)


@pytest.mark.parametrize("dtype", [torch.float32])  # half types round away what a break moves
def test_w4a16_matches_reference_and_is_row_invariant(dtype):
    torch.manual_seed(6)
    weight = quantize_int4(torch.randn(72, 256), group_size=32)
    tensors = (weight.packed.to(DEVICE), weight.scales.to(DEVICE), weight.mins.to(DEVICE))
    x = torch.randn(70, 256, device=DEVICE).to(dtype)
    cfg = ig.Config(16, 32, 32, splits=3, warps=1, stages=1)
    ref = w4a16_matmul_ref(x.double(), *tensors, 32)
    _close(ig.w4a16_linear(x, *tensors, 32, cfg), ref, dtype)
    _close(ig.w4a16_linear(x, *tensors, 32), ref, dtype)
    _rows_alike(lambda rows: ig.w4a16_linear(rows, *tensors, 32, cfg), x)


def test_split_partials_add_in_range_order():
    """sum_splits adds range 0, then 1, then 2 (float32 addition is not associative: torch's sum(0) may pair
    them otherwise), then scale and bias."""
    big, small = 2.0 ** 24, 1.0
    parts = torch.tensor([[[big]], [[small]], [[small]]], device=DEVICE)  # (big + 1) + 1 = big in float32
    assert ig.sum_splits(parts, torch.float32).item() == big
    parts = torch.tensor([[[small]], [[small]], [[big]]], device=DEVICE)
    assert ig.sum_splits(parts, torch.float32).item() == big + 2
    scaled = ig.sum_splits(parts, torch.float32, torch.tensor([0.5], device=DEVICE), torch.tensor([1.0], device=DEVICE))
    assert scaled.item() == (big + 2) * 0.5 + 1


def test_tiles_come_from_the_weight_alone():
    """Llama-3.1-8B's projections (N, K) at bfloat16: the splits that keep batch-1 decode's programs near
    an H200's 132 SMs, the same for every M (config takes no M)."""
    splits = {shape: ig.config(*shape, torch.bfloat16).splits
              for shape in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096))}
    assert splits == {(6144, 4096): 3, (4096, 4096): 5, (28672, 4096): 1, (4096, 14336): 5, (128256, 4096): 1}
    assert ig.split_count(64, 64, 64, 64) == 1  # too short a K to split


@pytest.mark.parametrize("kind", ["dense", "fp8", "fp8 blocks", "int8", "int4"])
def test_a_row_elsewhere_in_its_tile_keeps_its_bits(kind, row_dot):
    """With support.row_dot's tl.dot (each row of a tile its own product, as a GPU's MMA computes every row alike):
    windows of rows that start elsewhere (every row at another place in its tile, or in another tile) give the
    bits the whole batch gives. Without row_dot numpy's own dot moves them (this module's docstring; seen)."""
    torch.manual_seed(8)
    x = torch.randn(70, 256, device=DEVICE)
    small = ig.Config(16, 32, 32, splits=3, warps=1, stages=1)
    if kind == "dense":
        w = torch.randn(72, 256, device=DEVICE)
        compute = lambda rows: ig.linear(rows, w, cfg=SPLIT)  # noqa: E731
    elif kind.startswith("fp8"):
        qweight, scales = (t.to(DEVICE) for t in quantize_fp8(torch.randn(72, 256)))
        blocks = (torch.rand(5, 8) / 50 + 1e-3).to(DEVICE)
        compute = (lambda rows: ig.fp8_linear(rows, qweight, scales, SPLIT)) if kind == "fp8" else \
            (lambda rows: ig.fp8_block_linear(rows, qweight, blocks, (16, 32), SPLIT))
    elif kind == "int8":
        q8, s8 = (t.to(DEVICE) for t in quantize_int8(torch.randn(72, 256)))
        compute = lambda rows: ig.w8a16_linear(rows, q8, s8, small)  # noqa: E731
    else:
        w4 = quantize_int4(torch.randn(72, 256), group_size=32)
        tensors = (w4.packed.to(DEVICE), w4.scales.to(DEVICE), w4.mins.to(DEVICE))
        compute = lambda rows: ig.w4a16_linear(rows, *tensors, 32, small)  # noqa: E731
    full = compute(x)
    for start, rows in ((3, 64), (9, 1), (61, 9)):
        assert torch.equal(compute(x[start:start + rows]), full[start:start + rows]), (start, rows)
