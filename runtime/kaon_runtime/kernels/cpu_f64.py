"""float64 on CPU, each row alone (issue 49 §2): cpu_decode.c's kaon_linear_f64 and kaon_attention_f64 through ctypes.

A float64 model is the tests' exactness oracle against transformers' float64, and torch's float64 GEMMs move a row's
bits with the step's row count (their blocking does), so its answers moved with batch neighbours, chunking and
prefix-cache hits. These kernels sum every output of a row in one order fixed by the weight's shape (and, for
attention, by the row's own context), whatever the rows beside it, the thread count or the tile; layers/rows_alone.py
puts them under a float64 model's projections, head, experts and attention. The same library as the fused step
(cpu_decode.library(): built once per machine); `available()` is False where it cannot be built.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from kaon_runtime.kernels import cpu_decode


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cpu_decode.library()
    if lib is None:
        return None
    pointer, i32 = ctypes.c_void_p, ctypes.c_int
    lib.kaon_linear_f64.restype = None
    lib.kaon_linear_f64.argtypes = [pointer, pointer, pointer, pointer, i32, i32, i32, i32, i32]
    lib.kaon_attention_f64.restype = None
    lib.kaon_attention_f64.argtypes = [pointer, pointer, pointer, pointer, pointer, *[i32] * 8, ctypes.c_double,
                                       ctypes.c_double, pointer, pointer, i32]
    return lib


def available() -> bool:
    """Whether the kernels are built (a C compiler, KAON_CPU_DECODE not off)."""
    return _library() is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           transposed: bool = False) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias) in float64, weight [N, K] (transposed: [K, N], the vocabulary head's layout);
    each output of a row summed in an order that depends on K alone (cpu_decode.c tile_f64, linear_f64_t_chunk)."""
    lib = _library()
    assert lib is not None, "the float64 kernels are not built (cpu_f64.available())"
    x, weight = x.contiguous(), weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    n = weight.shape[1] if transposed else weight.shape[0]
    assert x.dtype == weight.dtype == torch.float64 and x.shape[1] == weight.shape[0 if transposed else 1]
    assert bias is None or (bias.dtype == torch.float64 and bias.shape == (n,))
    out = torch.empty(x.shape[0], n, dtype=torch.float64)
    lib.kaon_linear_f64(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
                        x.shape[0], n, x.shape[1], int(transposed), torch.get_num_threads())
    return out


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
              lens: torch.Tensor, scale: float, window: int | None = None,
              softcap: float | None = None) -> torch.Tensor:
    """Each row's query q [T, H, D] against its own context in the float64 cache [Hkv, blocks, block_size, D]:
    tables [T, M] (padded with any block), lens [T] (the keys row t sees, itself included); window: the keys a
    query sees, itself included (None: all); softcap: scores become softcap * tanh(score / softcap). [T, H, D]."""
    lib = _library()
    assert lib is not None, "the float64 kernels are not built (cpu_f64.available())"
    rows, heads, dim = q.shape
    kv_heads, num_blocks, block_size, _ = k_cache.shape
    assert q.dtype == k_cache.dtype == v_cache.dtype == torch.float64 and k_cache.is_contiguous()
    assert v_cache.is_contiguous() and heads % kv_heads == 0
    q = q.contiguous()
    tables, lens = tables.to(torch.int64).contiguous(), lens.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    if rows == 0:
        return out
    max_blocks = tables.shape[1]
    work = torch.empty(rows * heads * max_blocks * block_size, dtype=torch.float64)
    lib.kaon_attention_f64(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                           rows, heads, kv_heads, dim, num_blocks, block_size, max_blocks, window or 0, scale,
                           softcap or 0.0, out.data_ptr(), work.data_ptr(), torch.get_num_threads())
    return out
