"""Applying token bitmasks to a batch of logits: one batched operation, rows without a grammar untouched.

A bitmask row holds ceil(V / 32) int32 words; bit i of word w allows token 32 w + i (xgrammar's
layout). Forbidden tokens get -inf, so every sampler downstream (greedy argmax, temperature,
top-k/top-p, seeded draws, logprobs, speculative verification) sees only allowed tokens
without knowing about grammars.

On the CPU, float32 and bfloat16 logits go through xgrammar's C++ kernel (a tenth of the time of
the torch expression at batch 1); everything else through `apply_bitmasks_ref`, the torch
reference the kernel is tested against (on a GPU that is a few small kernels on [rows, V]).
"""
from __future__ import annotations

import torch

from kaon_runtime.arith import ceil_div

_BITS = torch.arange(32, dtype=torch.int32)
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A bitmask of `rows` rows allowing every token (all bits set), on the CPU where matchers fill it."""
    return torch.full((rows, ceil_div(vocab_size, 32)), -1, dtype=torch.int32)


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 words -> [R, vocab_size] bool, True where the token is allowed."""
    bits = (bitmask[:, :, None] >> _BITS.to(bitmask.device)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmasks(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Set the forbidden tokens of each `logits[r]`, r in rows, to -inf by `bitmask[r]`; in place.

    logits [N, V] (any float dtype, any device); bitmask [N, ceil(V / 32)] int32 on the CPU.
    Rows not listed are neither read nor written. Returns logits.
    """
    if not rows:
        return logits
    if logits.device.type == "cpu" and logits.dtype in _KERNEL_DTYPES and logits.is_contiguous():
        # Imported on first use: xgrammar takes seconds to import, which unconstrained serving never pays.
        from xgrammar.kernels.apply_token_bitmask_inplace_cpu import apply_token_bitmask_inplace_cpu
        apply_token_bitmask_inplace_cpu(logits, bitmask, logits.shape[1], rows)
        return logits
    return apply_bitmasks_ref(logits, bitmask, rows)


def apply_bitmasks_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The torch expression of `apply_bitmasks`."""
    index = torch.tensor(rows, device=logits.device)
    allowed = unpack(bitmask[rows].to(logits.device, non_blocking=True), logits.shape[1])
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return logits
