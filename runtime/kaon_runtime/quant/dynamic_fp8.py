"""Dynamic per-token FP8 activations (compressed-tensors `float-quantized` FP8 dynamic, W8A8: `input_activations`
with `type: float`, `num_bits: 8`, `dynamic: true`, `strategy: token`): each row of a linear's input is
rounded to FP8 E4M3 at run time, as the compressed-tensors spec does it, before the FP8 weight multiplies it.

Per token (row) x: scale = max |x| / 448 (E4M3's largest value; a zero row takes float32's eps),
x' = float(fp8(clamp(x / scale, -448, 448))) * scale. The rounding is done in float32 (fake quantization,
as transformers and compressed-tensors do it), then the weight's own matmul runs on x'. A GPU with FP8
tensor cores (quant/fp8.py's torch._scaled_mm path) quantizes each row the same way itself, so there the
input goes through untouched.
"""
from __future__ import annotations

import torch
from torch import nn

from kaon_runtime.kernels import cpu_decode
from kaon_runtime.quant.fp8 import FP8, Fp8Linear, scaled_mm_supported

_FP8_MAX = float(torch.finfo(FP8).max)  # 448


def round_to_fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] with each row rounded to its own FP8 E4M3 grid, in x's dtype (computed in float32)."""
    x32 = x.float()
    scale = x32.abs().amax(dim=-1, keepdim=True) / _FP8_MAX
    scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)
    q = (x32 / scale).clamp(-_FP8_MAX, _FP8_MAX).to(FP8).float()
    return (q * scale).to(x.dtype)


class DynamicFp8InputLinear(nn.Module):
    """An FP8-weight linear whose input rows are rounded to FP8 per token first (W8A8 FP8 dynamic)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        if not isinstance(inner, Fp8Linear):
            raise ValueError(f"dynamic FP8 activations need per-channel or per-tensor FP8 weights, got "
                             f"{type(inner).__name__}")
        self.inner = inner
        self.in_features, self.out_features = inner.in_features, inner.out_features  # as an nn.Linear's

    def fused_cpu_weights(self) -> cpu_decode.LinearWeights:
        """The fused CPU step's FP8_A8 kind: it rounds each input row to FP8 per token as
        round_to_fp8_per_token does (in float32), then multiplies as the inner weight's kind does."""
        return self.inner.fused_cpu_weights(fp8_inputs=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        # torch._scaled_mm quantizes each row itself; the batch-invariant kernel (quant/invariant.py) does not
        if scaled_mm_supported(rows, self.inner.qweight) and not self.inner.batch_invariant:
            return self.inner(x)
        return self.inner(round_to_fp8_per_token(x))
