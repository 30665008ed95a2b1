"""GGUF quantized blocks -> kaon's own quantized weights, without changing a weight.

Each type's integer values and scales are taken apart and put into the kaon layout that holds
them exactly (`repack`; tests/unit/runtime/quant/test_gguf_quant.py checks every type against the gguf
package's own dequantizer):

  Q4_0, Q4_1      -> Int4Weight, groups of 32, float16 scale and min (Q4_0: min = -8 * scale)
  Q4_K            -> BitPlanesWeight, 4 bits (no high plane), groups of 32, float32 scale d * sc
                     and min -dmin * m (float16 would round the products of a float16 and a 6-bit
                     integer), held once in the fused kernel's layout
  Q5_0, Q5_1, Q5_K -> BitPlanesWeight, 5 bits, groups of 32: scale and min float16 (Q5_0's min
                     -16 * d, exact) or, for Q5_K's products, float32
  Q6_K            -> BitPlanesWeight, 6 bits, groups of 16, offset 32, float32 d * sc
  Q8_0, Q2_K, Q3_K
                  -> GroupInt8Weight, groups of 16: the values fit int8; Q2_K and Q3_K scale
                     every 16 elements, which kaon's int4 (groups of 32) cannot carry, so they
                     take the int8 layout (more memory, no loss)
(quant/bit_planes.py says why 5- and 6-bit values are held as a 4-bit plane and high-bit planes.)

A block's layout is ggml's (ggml-common.h); the element order inside each is written out below.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kaon_runtime.kernels.quant_gemm_ref import pack_int4, unpack_int4
from kaon_runtime.quant.bit_planes import BitPlanesWeight, concat_bit_planes
from kaon_runtime.quant.group_int8 import GROUP_SIZE, GroupInt8Weight, concat_rows
from kaon_runtime.quant.int4 import Int4Weight

Q4_1_GROUP = 32
_BLOCK_BYTES = 20
# GGML type -> (elements, bytes) per block, for the types kaon keeps quantized
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
          "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")

KaonWeight = Int4Weight | GroupInt8Weight | BitPlanesWeight


def int4_from_q4_1(blocks: torch.Tensor) -> Int4Weight:
    """uint8 [N, K / 32, 20] -> Int4Weight with group_size 32: a Q4_1 block (float16 d, float16 m,
    16 bytes of 4-bit q: byte j holds element j low, j + 16 high; w = d * q + m) is Int4Weight's
    layout, so only the fields are split apart."""
    assert blocks.dtype == torch.uint8 and blocks.dim() == 3 and blocks.shape[2] == _BLOCK_BYTES, \
        f"Q4_1 blocks must be uint8 [rows, blocks, {_BLOCK_BYTES}], got {blocks.dtype} {tuple(blocks.shape)}"
    rows = blocks.shape[0]
    scales = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
    mins = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1)
    packed = blocks[..., 4:].reshape(rows, -1)
    return Int4Weight(packed, scales.contiguous(), mins.contiguous(), Q4_1_GROUP)


def repack(type_name: str, data: torch.Tensor | np.ndarray) -> KaonWeight:
    """One tensor's blocks, uint8 [rows, bytes per row], as the kaon weight that holds it exactly."""
    if type_name not in BLOCKS:
        raise ValueError(f"GGUF type {type_name} has no kaon layout")
    array = np.ascontiguousarray(np.asarray(data, dtype=np.uint8))
    rows = array.shape[0]
    size = BLOCKS[type_name][1]
    if array.ndim != 2 or array.shape[1] % size:
        raise ValueError(f"{type_name} rows of {array.shape[1:]} bytes are not whole {size}-byte blocks")
    blocks = array.reshape(rows, -1, size)
    return _REPACKS[type_name](blocks)


def widen(weight: KaonWeight) -> GroupInt8Weight:
    """An int4 or 5-/6-bit weight in the group-int8 layout, exactly: for a fused projection whose
    parts came in different types (Q4_K_M's q/k in Q5_0 beside v in Q8_0)."""
    if isinstance(weight, GroupInt8Weight):
        return weight
    if isinstance(weight, BitPlanesWeight):
        q = (weight.values.to(torch.int16) - weight.offset).to(torch.int8)
        per16 = weight.group_size // GROUP_SIZE
        mins = None if weight.mins is None else weight.mins.float().repeat_interleave(per16, dim=1)
        return GroupInt8Weight(q, weight.scales.float().repeat_interleave(per16, dim=1), mins)
    rows = weight.packed.shape[0]
    q = unpack_int4(weight.packed, weight.group_size).reshape(rows, -1).to(torch.int8)
    per16 = weight.group_size // GROUP_SIZE
    return GroupInt8Weight(q, weight.scales.float().repeat_interleave(per16, dim=1),
                           weight.mins.float().repeat_interleave(per16, dim=1))


def concat(parts: list[KaonWeight]) -> KaonWeight:
    """Parts stacked along the output rows in one layout: int4 when all are int4 alike, 5 or 6 bits when
    all are of one such shape, else group int8."""
    if all(isinstance(p, BitPlanesWeight) for p in parts):
        planes = concat_bit_planes([p for p in parts if isinstance(p, BitPlanesWeight)])
        if planes is not None:
            return planes
    if all(isinstance(p, Int4Weight) for p in parts):
        int4 = [p for p in parts if isinstance(p, Int4Weight)]
        if len({(p.group_size, p.scales.dtype) for p in int4}) == 1:
            return Int4Weight(torch.cat([p.packed for p in int4]), torch.cat([p.scales for p in int4]),
                              torch.cat([p.mins for p in int4]), int4[0].group_size)
        if len({p.group_size for p in int4}) == 1:
            return Int4Weight(torch.cat([p.packed for p in int4]), torch.cat([p.scales.float() for p in int4]),
                              torch.cat([p.mins.float() for p in int4]), int4[0].group_size)
    return concat_rows([widen(p) for p in parts])


# ---- one function per type: blocks uint8 [rows, blocks, bytes] -> the kaon weight -------------

def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per block -> float32 [rows, blocks] (float16's value, exactly)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """16 bytes per 32-block, element j low and j + 16 high -> values [rows, blocks, 32]."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _int4(values: np.ndarray, scales: np.ndarray, mins: np.ndarray, dtype: torch.dtype) -> Int4Weight:
    rows = values.shape[0]
    packed = pack_int4(torch.from_numpy(values.reshape(rows, -1).astype(np.uint8)), Q4_1_GROUP)
    return Int4Weight(packed, torch.from_numpy(scales.reshape(rows, -1)).to(dtype),
                      torch.from_numpy(mins.reshape(rows, -1)).to(dtype), Q4_1_GROUP)


def _group_int8(values: np.ndarray, scales: np.ndarray, mins: np.ndarray | None) -> GroupInt8Weight:
    """values [rows, ...] (any integer dtype, fits int8), scales (and mins) per group of 16 or 32."""
    rows = values.shape[0]
    q = torch.from_numpy(values.reshape(rows, -1).astype(np.int8))
    k = q.shape[1]

    def per16(t: np.ndarray) -> torch.Tensor:
        groups = torch.from_numpy(np.ascontiguousarray(t, dtype=np.float32).reshape(rows, -1))
        return groups.repeat_interleave(k // GROUP_SIZE // groups.shape[1], dim=1)

    return GroupInt8Weight(q, per16(scales), None if mins is None else per16(mins))


def _q4_0(b: np.ndarray) -> Int4Weight:
    d = _f16(b[..., 0:2])
    mins = -8 * d  # exact: a power of two times a float16
    dtype = torch.float16 if np.isfinite(mins.astype(np.float16)).all() else torch.float32
    return _int4(_nibbles_32(b[..., 2:18]), d, mins, dtype)


def _q4_1(b: np.ndarray) -> Int4Weight:
    return int4_from_q4_1(torch.from_numpy(b))


def _q5(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 5-bit values [rows, blocks, 32]: a nibble and bit j of the little-endian qh."""
    high = (qh.astype(np.uint32) << np.array([0, 8, 16, 24], dtype=np.uint32)).sum(axis=-1, dtype=np.uint32)
    bits = (high[..., None] >> np.arange(32, dtype=np.uint32)) & 1
    return _nibbles_32(qs).astype(np.int16) | (bits.astype(np.int16) << 4)


def _planes(values: np.ndarray, scales: np.ndarray, mins: np.ndarray | None, bits: int, group: int,
            offset: int = 0, dtype: torch.dtype = torch.float32) -> BitPlanesWeight:
    """values [rows, ...] (unsigned, below 2 ** bits), scales (and mins) [rows, ...] per group."""
    rows = values.shape[0]

    def per_row(t: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(t, dtype=np.float32).reshape(rows, -1)).to(dtype)

    return BitPlanesWeight(torch.from_numpy(values.reshape(rows, -1).astype(np.uint8)), per_row(scales),
                           None if mins is None else per_row(mins), bits, group, offset)


def _q5_0(b: np.ndarray) -> BitPlanesWeight:
    d = _f16(b[..., 0:2])
    mins = -16 * d  # exact: a power of two times a float16
    dtype = torch.float16 if np.isfinite(mins.astype(np.float16)).all() else torch.float32
    return _planes(_q5(b[..., 2:6], b[..., 6:22]), d, mins, 5, 32, dtype=dtype)


def _q5_1(b: np.ndarray) -> BitPlanesWeight:
    return _planes(_q5(b[..., 4:8], b[..., 8:24]), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 5, 32, dtype=torch.float16)


def _q8_0(b: np.ndarray) -> GroupInt8Weight:
    return _group_int8(np.ascontiguousarray(b[..., 2:34]).view(np.int8), _f16(b[..., 0:2]), None)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's twelve bytes -> eight 6-bit scales and eight 6-bit mins (ggml's get_scale_min_k4)."""
    s = s.astype(np.int32)
    low_sc, low_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    high_sc = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    high_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return np.concatenate([low_sc, high_sc], axis=-1), np.concatenate([low_m, high_m], axis=-1)


def _k_scale_min(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per 32-element sub-block: d * sc and -(dmin * m), both exact in float32."""
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    sc, m = _k_scales(b[..., 4:16])
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _q4_k(b: np.ndarray) -> BitPlanesWeight:
    # 128 bytes: for j < 4, sub-block 2j in the low nibbles of bytes 32j.., 2j + 1 in their high ones
    qs = b[..., 16:144].reshape(*b.shape[:2], 4, 1, 32)
    values = np.concatenate([qs & 0x0F, qs >> 4], axis=-2)
    scales, mins = _k_scale_min(b)
    return _planes(values, scales, mins, 4, 32)


def _q5_k(b: np.ndarray) -> BitPlanesWeight:
    qh = b[..., 16:48][..., None, :]  # bit i of byte l: the fifth bit of element 32i + l
    qs = b[..., 48:176].reshape(*b.shape[:2], 4, 1, 32)
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=-2).reshape(*b.shape[:2], 8, 32)
    high = (qh >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    scales, mins = _k_scale_min(b)
    return _planes(low | (high << 4), scales, mins, 5, 32)


def _q6_k(b: np.ndarray) -> BitPlanesWeight:
    # per 128-element half n: ql bytes 64n.. hold elements l (low nibble) and 64 + l (high) of 32n..;
    # qh byte 32n + l holds the top two bits of elements l, 32 + l, 64 + l, 96 + l
    lead = b.shape[:2]
    ql = b[..., 0:128].reshape(*lead, 2, 2, 1, 32)  # [half, which 32 bytes, -, l]
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-2)  # [half, 2, 2 (low/high nibble), 32]
    low = low.transpose(0, 1, 2, 4, 3, 5).reshape(*lead, 2, 4, 32)  # element 32 * (2 * nibble + byte) + l
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
    scales = _f16(b[..., 208:210])[..., None] * np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    return _planes(low | (high << 4), scales, None, 6, 16, offset=32)


def _q2_k(b: np.ndarray) -> GroupInt8Weight:
    # element 128n + 32j + l: bits 2j of byte 32n + l; sixteen 16-element groups in order
    qs = b[..., 16:80].reshape(*b.shape[:2], 2, 1, 32)
    values = (qs >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
    s = b[..., 0:16].astype(np.float32)
    d, dmin = _f16(b[..., 80:82])[..., None], _f16(b[..., 82:84])[..., None]
    return _group_int8(values, d * (s % 16), -(dmin * np.floor(s / 16)))


def _q3_k(b: np.ndarray) -> GroupInt8Weight:
    # element 128n + 32j + l: two bits 2j of byte 32n + l, and bit 4n + j of hmask byte l clear means -4
    hmask = b[..., 0:32][..., None, :]
    qs = b[..., 32:96].reshape(*b.shape[:2], 2, 1, 32)
    low = ((qs >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3).reshape(*b.shape[:2], 8, 32)
    high = (hmask >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    values = low.astype(np.int16) - 4 * (1 - high.astype(np.int16))
    s = b[..., 96:108].astype(np.int32)  # sixteen 6-bit scales: low nibbles 0-7, high nibbles 0-7, two bits each
    low_bits = np.concatenate([s[..., 0:8] & 0x0F, s[..., 0:8] >> 4], axis=-1)
    high_bits = np.concatenate([(s[..., 8:12] >> shift) & 3 for shift in (0, 2, 4, 6)], axis=-1)
    sc = (low_bits | (high_bits << 4)) - 32
    return _group_int8(values, _f16(b[..., 108:110])[..., None] * sc.astype(np.float32), None)


_REPACKS: dict[str, Callable[[np.ndarray], KaonWeight]] = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
