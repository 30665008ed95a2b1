"""GGUF quantized types kept quantized: each type's blocks repacked into kaon's layouts
(quant/gguf.py) dequantize to exactly what the gguf package's own dequantizer gives, and the
fused CPU kernels read the new layouts (Q4_F32, Q8_G16) as torch computes them."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kaon_runtime.kernels import cpu_decode
from kaon_runtime.kernels.quant_gemm_ref import dequantize_int4, quantize_activations_ref
from kaon_runtime.quant import gguf as gguf_quant
from kaon_runtime.quant.bit_planes import BitPlanesLinear, BitPlanesWeight, dequantize_bit_planes
from kaon_runtime.quant.group_int8 import GroupInt8Linear, GroupInt8Weight, dequantize_group_int8
from kaon_runtime.quant.int4 import Int4Weight

gguf = pytest.importorskip("gguf")

TYPES = list(gguf_quant.BLOCKS)
# Where each K-quant keeps its float16 super-block scales (d, and dmin where it has one).
_F16_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def gguf_blocks(type_name: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, bytes per row] of `type_name`: quantized by gguf where it can, else blocks to
    the published layout (random bits, finite float16 super-block scales)."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name not in _F16_FIELDS:
        return np.asarray(gguf.quants.quantize(rng.standard_normal((rows, k)).astype(np.float32) * 0.05, qtype))
    elements, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, k // elements, size), dtype=np.uint8)
    for at in _F16_FIELDS[type_name]:
        scale = (rng.random((rows, k // elements)) * 0.01 + 1e-4).astype(np.float16)
        blocks[..., at:at + 2] = scale[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def dequantized(weight) -> torch.Tensor:
    if isinstance(weight, Int4Weight):
        return dequantize_int4(weight.packed, weight.scales, weight.mins, weight.group_size)
    if isinstance(weight, BitPlanesWeight):
        return dequantize_bit_planes(weight)
    return dequantize_group_int8(weight)


@pytest.mark.parametrize("type_name", TYPES)
def test_repacked_weights_dequantize_as_gguf_does(type_name):
    raw = gguf_blocks(type_name, rows=24, k=512)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).astype(np.float32))
    weight = gguf_quant.repack(type_name, raw)
    assert isinstance(weight, Int4Weight) == (type_name in ("Q4_0", "Q4_1"))
    assert isinstance(weight, BitPlanesWeight) == (type_name in ("Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K"))
    assert torch.equal(dequantized(weight), expected)
    if isinstance(weight, BitPlanesWeight):  # held no wider than the values: 5 or 6 bits each
        assert int(weight.values.max()) < 2 ** weight.bits


def test_mixed_parts_widen_to_group_int8_exactly():
    parts = [gguf_quant.repack(t, gguf_blocks(t, 16, 256, seed=i)) for i, t in enumerate(["Q4_K", "Q4_0", "Q6_K"])]
    fused = gguf_quant.concat(parts)
    assert isinstance(fused, GroupInt8Weight)
    assert torch.equal(dequantized(fused), torch.cat([dequantized(p) for p in parts]))
    q4_1 = gguf_quant.repack("Q4_1", gguf_blocks("Q4_1", 16, 256))
    int4 = gguf_quant.concat([parts[1], q4_1])  # float16 scales alike: one int4 weight
    assert isinstance(int4, Int4Weight)
    assert torch.equal(dequantized(int4), torch.cat([dequantized(parts[1]), dequantized(q4_1)]))
    planes = gguf_quant.concat([parts[0], gguf_quant.repack("Q4_K", gguf_blocks("Q4_K", 8, 256, seed=9))])
    assert isinstance(planes, BitPlanesWeight) and planes.bits == 4 and planes.values.shape == (24, 256)


def test_unknown_type_and_torn_rows_are_refused():
    with pytest.raises(ValueError, match="IQ2_XS"):
        gguf_quant.repack("IQ2_XS", np.zeros((2, 66), np.uint8))
    with pytest.raises(ValueError, match="34-byte blocks"):
        gguf_quant.repack("Q8_0", np.zeros((2, 50), np.uint8))


needs_c = pytest.mark.skipif(cpu_decode.compiler() is None, reason=cpu_decode.NO_COMPILER)  # a compile error fails


@needs_c
@pytest.mark.parametrize("type_name", ["Q4_K", "Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q2_K"])
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_fused_kernels_read_the_new_layouts(type_name, rows):
    """The C kernel multiplies int8-quantized activations: it must equal torch doing the same, in float32."""
    n, k = 20, 256  # n not a multiple of the 8 lanes
    weight = gguf_quant.repack(type_name, gguf_blocks(type_name, n, k, seed=3))
    if isinstance(weight, Int4Weight):
        fused = cpu_decode.LinearWeights.q4_f32(weight.packed, weight.scales, weight.mins)
    elif isinstance(weight, BitPlanesWeight):
        held = BitPlanesLinear(weight).kernel_weights
        assert held is not None
        fused = held
    else:
        fused = cpu_decode.LinearWeights.q8_g16(weight.qweight, weight.scales, weight.mins)
    x = torch.randn(rows, k)
    expected = quantize_activations_ref(x) @ dequantized(weight).double().t().float()
    torch.testing.assert_close(cpu_decode.linear(fused, x), expected, rtol=1e-4, atol=1e-4)


@needs_c
@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_1", "Q6_K"])
def test_kept_linears_on_cpu_match_their_float_weight(type_name):
    weight = gguf_quant.repack(type_name, gguf_blocks(type_name, 32, 256))
    layer = (BitPlanesLinear if isinstance(weight, BitPlanesWeight) else GroupInt8Linear)(weight, torch.randn(32))
    reference = torch.nn.Linear(256, 32)
    reference.weight.data, reference.bias.data = dequantized(weight), layer.bias.data
    for rows in (1, 200):  # the C kernel, then the dense GEMM
        x = torch.randn(rows, 256)
        expected = reference(x)  # random Q6_K blocks give outputs in the hundreds: error relative to those
        torch.testing.assert_close(layer(x), expected, rtol=2e-2, atol=2e-2 * float(expected.abs().max()))


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K"])
def test_4_5_and_6_bit_weights_are_held_once_in_their_own_width(type_name):
    """The kernel's planes are the module's only copy, give every value back, and take the values' own
    bits (a nibble, one or two high bits) plus the scales (and mins)."""
    rows, k = 20, 512  # 20 rows: padded to 24, three groups of the kernel's eight lanes
    weight = gguf_quant.repack(type_name, gguf_blocks(type_name, rows, k, seed=5))
    assert isinstance(weight, BitPlanesWeight)
    layer = BitPlanesLinear(weight)
    assert layer.kernel_weights is not None
    assert {t.data_ptr() for t in layer.kernel_weights.tensors} <= {b.data_ptr() for b in layer.buffers()}
    back = layer.weight
    assert torch.equal(back.values, weight.values) and torch.equal(dequantized(back), dequantized(weight))
    scale_bytes = weight.scales.element_size() * (2 if weight.mins is not None else 1) / weight.group_size
    per_weight = weight.bits / 8 + scale_bytes  # Q4_K 6 bits, Q5_0 and Q5_1 6, Q5_K 7, Q6_K 8
    assert sum(b.numel() * b.element_size() for b in layer.buffers()) == 24 * k * per_weight
