"""int8 weights with a scale, and optionally a min, per group along K: w = q * scale + min.

Two sources share it: GGUF's 5-, 6- and 8-bit types and Q2_K/Q3_K, in groups of 16 (quant/gguf.py
repacks them without changing a weight: their values fit int8, their scales are exact in
float32), and the 8-bit grouped checkpoints of GPTQ and compressed-tensors (groups of 32 to 128,
with zero points as mins; quant/checkpoint_formats).

On CPU, where the groups are whole multiples of 16, the weight is held once, in the layout the fused
kernels read (kernels/cpu_decode.py's Q8_G16: rows interleaved by eight, float32 scales per 16): the
decode step and few-row matmuls read those very tensors, many rows widen them for one dense GEMM. At a K
that is not whole activation blocks of 32 (an odd number of groups of 16, e.g. K = 48) that layout is
packed with a zero group (cpu_decode.padded_columns; Linear.k_in the true K), and `weight` / `rows` cut
it off: held once at every width (issue 49; before, such a module kept its own tensors and the step
made its padded copy beside them). Elsewhere the weight is held as given and widened per call.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kaon_runtime.kernels import cpu_decode
from kaon_runtime.kernels.quant_gemm_cpu import DENSE_ROWS, dense_dtype
from kaon_runtime.quant.linear import QuantizedLinear, kernel_for

GROUP_SIZE = cpu_decode.G16  # the kernel's group, and GGUF's
_LANES = cpu_decode.LANES  # the kernel's rows interleave in runs of this many


@dataclass(slots=True)
class GroupInt8Weight:
    qweight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # float [N, K / group_size]
    mins: torch.Tensor | None  # float [N, K / group_size], or None: symmetric
    group_size: int = GROUP_SIZE


def dequantize_group_int8(weight: GroupInt8Weight) -> torch.Tensor:
    """float32 [N, K]: q * scale (+ min), one rounding per element as GGUF's own dequantizer does."""
    rows, k = weight.qweight.shape
    w = weight.qweight.float().reshape(rows, -1, weight.group_size) * weight.scales.float()[..., None]
    if weight.mins is not None:
        w = w + weight.mins.float()[..., None]
    return w.reshape(rows, k)


def quantize_group_int8(weight: torch.Tensor, group_size: int = 2 * GROUP_SIZE) -> GroupInt8Weight:
    """Symmetric int8 per group along K, scale = max |w| / 127. A GGUF Q8_0 weight, whose blocks llama.cpp
    scales the same way, comes back exactly: each block's largest value is 127 times its scale."""
    rows, k = weight.shape
    groups = weight.float().reshape(rows, -1, group_size)
    scales = groups.abs().amax(dim=-1) / 127
    q = torch.round(groups / scales.clamp(min=torch.finfo(torch.float32).tiny)[..., None]).clamp(-127, 127)
    return GroupInt8Weight(q.to(torch.int8).reshape(rows, k), scales, None, group_size)


def in_groups_of_16(weight: GroupInt8Weight) -> GroupInt8Weight:
    """The same weight with its scales (and mins) repeated to groups of 16."""
    repeat = weight.group_size // GROUP_SIZE
    if repeat == 1:
        return weight
    mins = None if weight.mins is None else weight.mins.repeat_interleave(repeat, 1)
    return GroupInt8Weight(weight.qweight, weight.scales.repeat_interleave(repeat, 1), mins)


def concat_rows(parts: list[GroupInt8Weight]) -> GroupInt8Weight:
    """Parts stacked along N (a fused q|k|v or gate|up), in groups of 16; a part without mins gets zeros."""
    parts = [in_groups_of_16(p) for p in parts]
    mins = None
    if any(p.mins is not None for p in parts):
        mins = torch.cat([p.mins if p.mins is not None else torch.zeros_like(p.scales) for p in parts])
    return GroupInt8Weight(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]), mins)


def _kernel_reads(weight: GroupInt8Weight) -> bool:
    # (any K of whole groups: an odd number of groups of 16 is packed with a zero group, LinearWeights.q8_g16)
    return weight.qweight.device.type == "cpu" and weight.group_size % GROUP_SIZE == 0


class GroupInt8Linear(QuantizedLinear):
    qvalues: torch.Tensor  # buffers, declared for the type checker
    group_scales: torch.Tensor

    def __init__(self, weight: GroupInt8Weight, bias: torch.Tensor | None = None):
        rows, k = weight.qweight.shape
        if k % weight.group_size or weight.scales.shape != (rows, k // weight.group_size):
            raise ValueError(f"group int8: scales {tuple(weight.scales.shape)} do not fit a {rows} x {k} weight "
                             f"in groups of {weight.group_size}")
        super().__init__(k, rows, bias)
        self.group_mins: torch.Tensor | None
        # The fused kernels' struct over this module's own buffers (None where they are not in its layout).
        self.kernel_weights: cpu_decode.LinearWeights | None = None
        if _kernel_reads(weight):
            weight = in_groups_of_16(weight)
            held = cpu_decode.LinearWeights.q8_g16(weight.qweight, weight.scales, weight.mins, self.bias)
            qvalues, scales, *rest = held.tensors
            mins = rest[0] if weight.mins is not None else None
            self.kernel_weights = held
        else:
            qvalues, scales, mins = weight.qweight, weight.scales.float(), weight.mins
        self.group_size = weight.group_size
        self.register_buffer("qvalues", qvalues)
        self.register_buffer("group_scales", scales)
        self.register_buffer("group_mins", None if mins is None else mins.float())

    @property
    def weight(self) -> GroupInt8Weight:
        """The weight as [N, K] values and per-group scales (a copy where the kernel's layout holds it)."""
        if self.kernel_weights is None:
            return GroupInt8Weight(self.qvalues, self.group_scales, self.group_mins, self.group_size)
        n, k, packed = self.out_features, self.in_features, self.kernel_weights.struct.k  # (packed: whole blocks)
        # q: [row groups, K / 4, 8 lanes, 4] -> [N, K]; scales: [row groups, blocks, 2, 8 lanes] -> [N, K / 16]
        q = self.qvalues.transpose(1, 2).reshape(-1, packed)[:n, :k]

        def per_row(t: torch.Tensor) -> torch.Tensor:
            return t.permute(0, 3, 1, 2).reshape(-1, packed // GROUP_SIZE)[:n, :k // GROUP_SIZE]

        return GroupInt8Weight(q, per_row(self.group_scales),
                               None if self.group_mins is None else per_row(self.group_mins))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), K]: the dequantized rows `ids` (a tied token lookup reads the head's)."""
        if self.kernel_weights is None:
            weight = self.weight
            picked = GroupInt8Weight(weight.qweight[ids], weight.scales[ids],
                                     None if weight.mins is None else weight.mins[ids], weight.group_size)
            return dequantize_group_int8(picked)
        lane, group = ids % _LANES, torch.div(ids, _LANES, rounding_mode="floor")
        k, rows = self.in_features, len(ids)  # (the packing's zero group cut off)
        q = self.qvalues[group, :, lane].reshape(rows, -1)[:, :k]  # [rows, K / 4, 4] -> [rows, K]
        scales = self.group_scales[group, :, :, lane].reshape(rows, -1)[:, :k // GROUP_SIZE]  # [rows, K / 32, 2]
        mins = None if self.group_mins is None else self.group_mins[group, :, :, lane].reshape(rows, -1)[
            :, :k // GROUP_SIZE]
        return dequantize_group_int8(GroupInt8Weight(q, scales, mins))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        kernel = kernel_for(x, self.reference)
        if kernel == "cpu" and x.shape[0] >= DENSE_ROWS:
            dtype = dense_dtype()
            return torch.mm(x.to(dtype), dequantize_group_int8(self.weight).to(dtype).t()).to(x.dtype)
        if kernel == "cpu" and self.kernel_weights is not None and cpu_decode.library() is not None:
            # re-pointed at the buffers as they are now (sleep level 2 swaps their storage), without the bias
            return cpu_decode.linear(self.kernel_weights.rebound(bias=False), x).to(x.dtype)
        if kernel == "triton" and self.batch_invariant:  # quant/invariant.py
            from kaon_runtime.kernels import invariant_gemm  # on use: CPU-only torch builds lack Triton
            return invariant_gemm.linear(x, dequantize_group_int8(self.weight).to(x.dtype))
        compute = torch.float32 if x.device.type == "cpu" else x.dtype
        weight = dequantize_group_int8(self.weight).to(compute)
        return torch.nn.functional.linear(x.to(compute), weight).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, group_size={self.group_size}, mins={self.group_mins is not None}, "
                f"kernel_layout={self.kernel_weights is not None}")

