"""Decode's quantized matrix-vector kernels (kernels/quant_gemv.py) against the pure-torch references.

Through Triton's interpreter without a GPU (the plain widening path); compiled on a GPU, where the inline
PTX widening runs (bench/gpu/run.sh's kernel stage). Shapes are chosen to leave partial tiles: N not a
multiple of any tile's rows, K not a multiple of a step, so every mask is exercised.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kaon_runtime.kernels import quant_gemv
from kaon_runtime.kernels.quant_gemm_ref import w4a16_matmul_ref, w8a16_matmul_ref
from kaon_runtime.quant.fp8 import Fp8Linear, fp8_matmul_ref, quantize_fp8
from kaon_runtime.quant.fp8_block import Fp8BlockLinear, dequantize_fp8_blocks
from kaon_runtime.quant.int4 import Int4Linear, quantize_int4
from kaon_runtime.quant.int8 import Int8Linear, quantize_int8

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# float32 on the interpreter; bfloat16 (what a GPU serves) on a GPU, checked against float32 references.
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
TOLERANCE = 1e-2 if torch.bfloat16 == DTYPE else 1e-5
# Small tiles, so a few dozen rows and a few hundred columns still make several programs and steps;
# one tile loads x once per step for all rows, the other per thread.
TILES = {"shared x": quant_gemv.Tile(block_n=4, subs=8, warps=1), "x per thread":
         quant_gemv.Tile(block_n=2, subs=16, warps=1, x_shared=False)}
# The variants the GPU sweep tries beside those (bench/gpu/gemv_sweep.py), each with steps short enough
# that a row takes several, the last one partial: x once per thread for all weight rows; scales folded
# out of the inner loop; the next step prefetched; the rows inner (the [SUBS, BLOCK_N, VEC] tile); 16-byte
# runs; each x mode at least once.
VARIANTS = {"x once": quant_gemv.Tile(block_n=4, subs=4, warps=1, x_once=True),
            "folded": quant_gemv.Tile(block_n=2, subs=4, warps=1, fold=True),
            "folded x per thread prefetch": quant_gemv.Tile(block_n=2, subs=4, warps=1, x_shared=False, fold=True,
                                                            prefetch=True),
            "rows inner": quant_gemv.Tile(block_n=4, subs=4, warps=1, rows_inner=True, x_once=True),
            "rows inner folded 16-byte": quant_gemv.Tile(block_n=2, subs=2, warps=1, vec=16, rows_inner=True,
                                                         x_once=True, fold=True),
            "rows inner folded prefetch": quant_gemv.Tile(block_n=4, subs=4, warps=1, rows_inner=True, fold=True,
                                                          prefetch=True)}
TILES |= VARIANTS
# The variants interpreted take ~10 s each (2-core machine): `make unit` leaves them out, `make test`
# and the GPU's kernel stage run them.
SLOW_VARIANTS = [pytest.param(name, marks=pytest.mark.slow) for name in VARIANTS]


@pytest.fixture(autouse=True)
def tile(request, monkeypatch):
    """The shared-x tile, or the one a test names by parametrizing `tile_name`."""
    params = request.node.callspec.params if hasattr(request.node, "callspec") else {}
    name = params.get("tile_name", "shared x")
    monkeypatch.setattr(quant_gemv, "TILES", {fmt: TILES[name] for fmt in quant_gemv.TILES})


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    assert out.dtype == expected.dtype and torch.isfinite(out).all()
    return ((out.float() - expected.float()).norm() / expected.float().norm()).item()


def activations(rows: int, k: int) -> torch.Tensor:
    # A strided view (every other column of a wider tensor): the kernels must not assume contiguous x.
    return torch.randn(rows, 2 * k, device=DEVICE).to(DTYPE)[:, ::2]


@pytest.mark.parametrize(("tile_name", "rows", "group", "scale_dtype"), [
    ("shared x", 1, 32, torch.float16), ("shared x", 3, 128, torch.float32), ("x per thread", 1, 64, torch.float16),
    ("x per thread", 4, 32, torch.float32)])
def test_int4_matches_the_reference(tile_name, rows, group, scale_dtype):
    torch.manual_seed(rows + group)
    n, k = 13, 3 * group  # K / 2 bytes per row: not a whole number of steps for any tile above
    weight = quantize_int4(torch.randn(n, k), group)
    packed, scales, mins = (t.to(DEVICE) for t in (weight.packed, weight.scales.to(scale_dtype),
                                                    weight.mins.to(scale_dtype)))
    x = activations(rows, k)
    out = quant_gemv.w4a16_gemv(x, packed, scales, mins, group)
    assert relative_error(out, w4a16_matmul_ref(x.float(), packed, scales, mins, group).to(DTYPE)) < TOLERANCE


@pytest.mark.parametrize(("tile_name", "rows"), [("shared x", 2), ("x per thread", 1)])
def test_int8_matches_the_reference(tile_name, rows):
    torch.manual_seed(rows)
    qweight, scales = (t.to(DEVICE) for t in quantize_int8(torch.randn(13, 200)))
    qweight[0, :8] = torch.tensor([-127, -128, -1, 0, 1, 127, 64, -64], dtype=torch.int8)  # the byte's edges
    x = activations(rows, 200)
    out = quant_gemv.w8a16_gemv(x, qweight, scales)
    assert relative_error(out, w8a16_matmul_ref(x.float(), qweight, scales).to(DTYPE)) < TOLERANCE


@pytest.mark.parametrize("rows", [1, 3])
def test_fp8_matches_the_reference(rows):
    torch.manual_seed(rows)
    weight = torch.randn(13, 200)
    weight[0, :4] = torch.tensor([1e-3, -1e-3, 3e-4, 0.0])  # subnormal and zero e4m3 codes after scaling
    qweight, scales = (t.to(DEVICE) for t in quantize_fp8(weight))
    x = activations(rows, 200)
    out = quant_gemv.fp8_gemv(x, qweight, scales)
    assert relative_error(out, fp8_matmul_ref(x.float(), qweight, scales).to(DTYPE)) < TOLERANCE


@pytest.mark.parametrize("block", [(8, 64), (16, 32)])
def test_fp8_blocks_match_the_reference(block):
    torch.manual_seed(block[0])
    n, k = 20, 272  # partial blocks on both axes
    qweight = quantize_fp8(torch.randn(n, k))[0].to(DEVICE)
    scales = (torch.rand(-(-n // block[0]), -(-k // block[1])) + 0.5).to(DEVICE)
    x = activations(2, k)
    expected = torch.nn.functional.linear(x.float(), dequantize_fp8_blocks(qweight, scales, block)).to(DTYPE)
    assert relative_error(quant_gemv.fp8_block_gemv(x, qweight, scales, block), expected) < TOLERANCE


@pytest.mark.parametrize("tile_name", [name for name in TILES if name not in VARIANTS] + SLOW_VARIANTS)
def test_a_row_gets_the_same_bits_alone_as_in_a_batch(tile_name):
    """One accumulator per row of x, summed after the loop in a fixed order: a row's result must not
    depend on which other rows share the launch (batch invariance within the kernel), in every tile
    (the folded ones: x's run sums and the run scales per row too); int4 and the FP8 blocks."""
    torch.manual_seed(0)
    weight = quantize_int4(torch.randn(9, 192), 32)
    packed, scales, mins = (t.to(DEVICE) for t in (weight.packed, weight.scales, weight.mins))
    qweight = quantize_fp8(torch.randn(9, 192))[0].to(DEVICE)
    block_scales = (torch.rand(2, 3) + 0.5).to(DEVICE)
    x = torch.randn(4, 192, device=DEVICE).to(DTYPE)
    for gemv in (lambda x: quant_gemv.w4a16_gemv(x, packed, scales, mins, 32),
                 lambda x: quant_gemv.fp8_block_gemv(x, qweight, block_scales, (8, 64))):
        together = gemv(x)
        for row in range(4):
            assert torch.equal(gemv(x[row:row + 1])[0], together[row])


@pytest.mark.parametrize("tile_name", SLOW_VARIANTS)
def test_each_variant_matches_the_reference_in_every_format(tile_name):
    """The sweep's variants on every format and scale layout: int4 in groups of 32 (float16 scales, 3
    rows) and 128 (float32, 1 row), int8 and FP8 per row, FP8 blocks (partial on both axes)."""
    test_int4_matches_the_reference(tile_name, 3, 32, torch.float16)
    test_int4_matches_the_reference(tile_name, 1, 128, torch.float32)
    test_int8_matches_the_reference(tile_name, 2)
    test_fp8_matches_the_reference(1)
    test_fp8_blocks_match_the_reference((16, 32))


def test_linears_take_the_gemv_for_few_rows_and_the_gemm_for_more(monkeypatch):
    """The quantized linears' Triton path: up to the format's MAX_ROWS rows through these kernels, more
    through quant_gemm's tl.dot kernels (spied here: their interpreted run would take long)."""
    from kaon_runtime.kernels import quant_gemm
    monkeypatch.setenv("KAON_QUANT_KERNEL", "triton")
    monkeypatch.setattr(quant_gemv, "MAX_ROWS", dict.fromkeys(quant_gemv.MAX_ROWS, 3))
    used = []
    for name in ("w4a16_matmul", "w8a16_matmul"):
        monkeypatch.setattr(quant_gemm, name, lambda *a, _name=name, **kw: used.append(_name) or "gemm")
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 9, bias=False)
    fp8_blocks = Fp8BlockLinear(quantize_fp8(linear.weight.detach() * 64)[0], torch.full((1, 2), 1 / 64), (16, 32))
    modules = {"int4": Int4Linear.from_linear(linear), "int8": Int8Linear.from_linear(linear),
               "fp8": Fp8Linear.from_linear(linear), "fp8 blocks": fp8_blocks}
    for name, module in modules.items():
        module.to(DEVICE)
        x = torch.randn(3, 64, device=DEVICE).to(DTYPE)
        weight = dequantize_fp8_blocks(module.qweight, module.scales, module.block) if name == "fp8 blocks" \
            else linear.weight.to(DEVICE)
        expected = torch.nn.functional.linear(x.float(), weight).to(DTYPE)
        assert relative_error(module(x), expected) < 0.2, name  # the formats' own rounding
    assert used == []
    x = torch.randn(4, 64, device=DEVICE).to(DTYPE)
    assert modules["int4"].matmul(x) == "gemm" and modules["int8"].matmul(x) == "gemm"
    assert used == ["w4a16_matmul", "w8a16_matmul"]
