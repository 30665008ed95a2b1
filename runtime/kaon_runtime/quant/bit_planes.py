"""4-, 5- and 6-bit weights held in their own width: a 4-bit plane and a plane of the bits above it.

GGUF's Q5_0, Q5_1, Q5_K (5-bit values, a scale and a min per 32) and Q6_K (6-bit values, a
scale per 16) used to widen to int8 (quant/group_int8.py: 8 bits and a float32 scale per 16),
which made a loaded Q4_K_M or Q5_K_M file half as large again as the file. Here the unsigned
values u keep their own width: the low four bits in kaon's int4 layout (GGUF Q4_1's nibble
order), the rest in a plane of one or two bits per weight, and w = (u - offset) * scale + min.

Why planes rather than a 6-bit-aligned int layout: the fused CPU step already multiplies Q4_1's
nibbles against int8 activations with one u8 x s8 dot instruction per four weights, and a high
bit plane laid out byte for byte beside the nibbles (kernels/cpu_decode.py's q5 / q6_g16) joins
them with one shift, mask and or per vector, so the kernel is Q4_1's plus three instructions.
The values stay unsigned (u <= 63 keeps the u8 x s8 products exact); Q6_K's offset of 32 comes
off in integers in the kernel.

Three shapes, each what the file's blocks hold exactly:
  4 bits, groups of 32, float32 scale and min (Q4_K: d * sc, -dmin * m; no high plane): held here
         rather than as quant/int4.py's Int4Weight so that the kernel's copy is the only one (Int4Linear
         keeps its own layout and makes torch's for few-row matmuls);
  5 bits, groups of 32, scale and min (Q5_0: min = -16 d; Q5_1: d, m; Q5_K: d * sc, -dmin * m),
         float16 where the file's own float16s are the scale and min (Q5_0, Q5_1), else float32;
  6 bits, groups of 16, scale only, offset 32 (Q6_K: d * sc in float32).
On CPU the weight is held once, in the kernel's interleaved layout; elsewhere as given (values
uint8 [N, K]) and dequantized per call.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kaon_runtime.kernels import cpu_decode
from kaon_runtime.kernels.quant_gemm_cpu import DENSE_ROWS, dense_dtype
from kaon_runtime.quant.linear import QuantizedLinear, kernel_for

_LANES = cpu_decode.LANES


@dataclass(slots=True)
class BitPlanesWeight:
    values: torch.Tensor  # uint8 [N, K], each below 2 ** bits
    scales: torch.Tensor  # float16 or float32 [N, K / group_size]
    mins: torch.Tensor | None  # as scales, or None
    bits: int  # 4, 5 or 6
    group_size: int  # 32 (4 and 5 bits) or 16 (6 bits)
    offset: int = 0  # subtracted from every value: 32 for Q6_K


def dequantize_bit_planes(weight: BitPlanesWeight) -> torch.Tensor:
    """float32 [N, K]: (u - offset) * scale (+ min), one rounding per step as GGUF's dequantizer."""
    rows, k = weight.values.shape
    q = (weight.values.to(torch.int16) - weight.offset).float().reshape(rows, -1, weight.group_size)
    w = q * weight.scales.float()[..., None]
    if weight.mins is not None:
        w = w + weight.mins.float()[..., None]
    return w.reshape(rows, k)


def concat_bit_planes(parts: list[BitPlanesWeight]) -> BitPlanesWeight | None:
    """Parts of one shape stacked along N (a fused q|k|v or gate|up), or None where the shapes differ."""
    first = parts[0]
    if any((p.bits, p.group_size, p.offset, p.mins is None) != (first.bits, first.group_size, first.offset,
                                                                  first.mins is None) for p in parts):
        return None
    same = len({p.scales.dtype for p in parts}) == 1

    def cat(ts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(ts if same else [t.float() for t in ts])

    mins = None if first.mins is None else cat([p.mins for p in parts if p.mins is not None])
    return BitPlanesWeight(torch.cat([p.values for p in parts]), cat([p.scales for p in parts]), mins,
                           first.bits, first.group_size, first.offset)


def _kernel_layout(weight: BitPlanesWeight, bias: torch.Tensor | None) -> cpu_decode.LinearWeights | None:
    """The fused CPU kernel's copy, for the two shapes it reads (None: another shape, or off the CPU)."""
    if weight.values.device.type != "cpu" or weight.values.shape[1] % cpu_decode.QBLOCK:
        return None
    shape = (weight.bits, weight.group_size, weight.offset)
    if shape == (4, cpu_decode.QBLOCK, 0) and weight.mins is not None and weight.scales.dtype == torch.float32:
        packed = weight.values.reshape(weight.values.shape[0], -1, 2, 16)
        packed = (packed[:, :, 0] | (packed[:, :, 1] << 4)).reshape(weight.values.shape[0], -1)  # Q4_1's order
        return cpu_decode.LinearWeights.q4_f32(packed, weight.scales, weight.mins.float(), bias)
    if shape == (5, cpu_decode.QBLOCK, 0) and weight.mins is not None:
        return cpu_decode.LinearWeights.q5(weight.values, weight.scales, weight.mins, bias)
    if (weight.bits, weight.group_size, weight.offset) == (6, cpu_decode.G16, 32) and weight.mins is None:
        return cpu_decode.LinearWeights.q6_g16(weight.values, weight.scales.float(), bias)
    return None


def _values_from_kernel(nibbles: torch.Tensor, high: torch.Tensor, bits: int, n: int, k: int) -> torch.Tensor:
    """uint8 [N, K] back from the kernel's planes (the inverse of cpu_decode.LinearWeights.q5 / q6_g16)."""
    blocks = k // cpu_decode.QBLOCK
    raw = nibbles.reshape(-1, blocks, 4, _LANES, 4).permute(0, 3, 1, 2, 4)  # [g, lane, b, t, i]
    low = torch.stack([raw & 0x0F, raw >> 4], dim=3)  # [g, lane, b, half, t, i]: value 16 half + 4t + i
    if bits == 4:
        return low.reshape(-1, k)[:n]
    if bits == 5:
        plane = high.reshape(-1, blocks, _LANES, 4).permute(0, 2, 1, 3)[:, :, :, None, None, :]  # [g, lane, b, 1, 1, i]
        shifts = torch.arange(8, dtype=torch.uint8).reshape(2, 4, 1)
    else:
        plane = high.reshape(-1, blocks, 2, _LANES, 4).permute(0, 3, 1, 2, 4)[:, :, :, :, None, :]  # [g, l, b, h, 1, i]
        shifts = (2 * torch.arange(4, dtype=torch.uint8)).reshape(4, 1)
    top = (plane >> shifts) & ((1 << (bits - 4)) - 1)
    return (low | (top << 4)).reshape(-1, k)[:n]


class BitPlanesLinear(QuantizedLinear):
    nibbles: torch.Tensor  # buffers, declared for the type checker
    high: torch.Tensor
    plane_scales: torch.Tensor

    def __init__(self, weight: BitPlanesWeight, bias: torch.Tensor | None = None):
        rows, k = weight.values.shape
        if k % weight.group_size or weight.scales.shape != (rows, k // weight.group_size):
            raise ValueError(f"{weight.bits}-bit weight: scales {tuple(weight.scales.shape)} do not fit a "
                             f"{rows} x {k} weight in groups of {weight.group_size}")
        super().__init__(k, rows, bias)
        self.bits, self.group_size, self.offset = weight.bits, weight.group_size, weight.offset
        self.plane_mins: torch.Tensor | None
        held = _kernel_layout(weight, self.bias)
        # The fused kernels' struct over this module's own buffers (None where they are not in its layout).
        self.kernel_weights: cpu_decode.LinearWeights | None = held
        self._unbiased: cpu_decode.LinearWeights | None = None  # the same without the bias, for matmul
        self._scales_dtype = weight.scales.dtype
        if held is not None:
            unbiased = cpu_decode.Linear.from_buffer_copy(held.struct)
            unbiased.bias = None
            self._unbiased = cpu_decode.LinearWeights(unbiased, held.tensors)
            nibbles, *rest = held.tensors
            high = rest.pop(0) if weight.bits > 4 else torch.empty(0, dtype=torch.uint8)
            scales, mins = rest[0], rest[1] if weight.mins is not None else None
        else:
            nibbles, high, scales, mins = weight.values, torch.empty(0, dtype=torch.uint8), weight.scales, weight.mins
        self.register_buffer("nibbles", nibbles)
        self.register_buffer("high", high)
        self.register_buffer("plane_scales", scales)
        self.register_buffer("plane_mins", mins)

    @property
    def weight(self) -> BitPlanesWeight:
        """The weight as values [N, K] and per-group scales (a copy where the kernel's layout holds it)."""
        if self.kernel_weights is None:
            return BitPlanesWeight(self.nibbles, self.plane_scales, self.plane_mins, self.bits, self.group_size,
                                   self.offset)
        n, k = self.out_features, self.in_features
        values = _values_from_kernel(self.nibbles, self.high, self.bits, n, k)
        per_block = 2 if self.group_size == cpu_decode.G16 else 1

        def per_row(t: torch.Tensor) -> torch.Tensor:  # [g, b, (half,) lane] -> [N, K / group]
            t = t.reshape(-1, k // cpu_decode.QBLOCK * per_block, _LANES)
            return t.transpose(1, 2).reshape(-1, k // self.group_size)[:n].to(self._scales_dtype)

        return BitPlanesWeight(values, per_row(self.plane_scales),
                               None if self.plane_mins is None else per_row(self.plane_mins),
                               self.bits, self.group_size, self.offset)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        kernel = kernel_for(x, self.reference)
        if kernel == "cpu" and x.shape[0] >= DENSE_ROWS:
            dtype = dense_dtype()
            return torch.mm(x.to(dtype), dequantize_bit_planes(self.weight).to(dtype).t()).to(x.dtype)
        if kernel == "cpu" and self._unbiased is not None and cpu_decode.library() is not None:
            return cpu_decode.linear(self._unbiased, x).to(x.dtype)
        if kernel == "triton" and self.batch_invariant:  # quant/invariant.py
            from kaon_runtime.kernels import invariant_gemm  # on use: CPU-only torch builds lack Triton
            return invariant_gemm.linear(x, dequantize_bit_planes(self.weight).to(x.dtype))
        compute = torch.float32 if x.device.type == "cpu" else x.dtype
        weight = dequantize_bit_planes(self.weight).to(compute)
        return torch.nn.functional.linear(x.to(compute), weight).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, bits={self.bits}, group_size={self.group_size}, "
                f"kernel_layout={self.kernel_weights is not None}")
