"""Static activation quantization a checkpoint was calibrated with (compressed-tensors' input_activations
with `dynamic: false`, one `input_scale` per linear): each quantized linear's input is rounded to the
checkpoint's grid (FP8 e4m3, or int8 with an optional zero point) before its product, so kaon computes
what the publisher evaluated. The rounding is done in float (fake quantization): the weights' kernels
then multiply as they do for any input. On CPU the fused C step reads int8 weights behind an int8 grid
as its kind INT8_S8 (kernels/cpu_decode.c): the same rounding, then the integer levels times the weights
summed exactly in int32 and scaled once (the same values; float rounding apart from this module's float
product), each row's own whatever the step's size (issue 49 §2)."""
from __future__ import annotations

import torch
from torch import nn

from kaon_runtime.kernels import cpu_decode
from kaon_runtime.quant.fp8 import Fp8Linear
from kaon_runtime.quant.fp8_block import Fp8BlockLinear
from kaon_runtime.quant.linear import ChannelScaledLinear

KINDS = ("fp8", "int8")
_FP8_MAX = 448.0  # float8_e4m3fn's largest value


def round_to_grid(x: torch.Tensor, scale: torch.Tensor, kind: str, zero_point: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """x as the static quantization of `kind` with per-tensor `scale` (and zero point) gives it back."""
    scaled = x.float() / scale
    if kind == "fp8":
        q = scaled.clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).float()
    else:
        zero = 0.0 if zero_point is None else zero_point.float()
        q = (scaled.round() + zero).clamp(-128, 127) - zero
    return (q * scale).to(x.dtype)


class StaticInputLinear(nn.Module):
    """A quantized linear whose input is first rounded to the checkpoint's static activation grid."""

    scale: torch.Tensor  # buffers, declared for the type checker
    zero_point: torch.Tensor | None

    def __init__(self, inner: nn.Module, kind: str, scale: torch.Tensor, zero_point: torch.Tensor | None = None):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"static activation quantization {kind!r} is not supported; supported: {KINDS}")
        self.inner, self.kind = inner, kind
        self.in_features, self.out_features = inner.in_features, inner.out_features  # as an nn.Linear's
        self.register_buffer("scale", scale.float().reshape(()))
        self.register_buffer("zero_point", None if zero_point is None else zero_point.float().reshape(()))

    def fused_cpu_weights(self) -> cpu_decode.LinearWeights:
        """The fused CPU step's kind for a static grid: FP8_STATIC for FP8 inputs over per-channel / per-tensor FP8
        weights (each input row rounded to FP8 at this fixed scale as round_to_grid does, float32, then the inner
        weight's arithmetic), FP8_BLOCK with the same rounding over block-scaled FP8 weights; INT8_S8 for an int8
        grid before per-channel int8 weights (the grid's integer levels times the weights summed exactly in int32).
        Other grids and weights have no kind: the step is not built for them (their scheme says so)."""
        inner = self.inner
        if self.kind == "fp8" and isinstance(inner, (Fp8Linear, Fp8BlockLinear)):
            return inner.fused_cpu_weights(input_scale=float(self.scale))
        if self.kind == "int8" and isinstance(inner, ChannelScaledLinear) and inner.qweight.dtype == torch.int8:
            zero = 0.0 if self.zero_point is None else float(self.zero_point)
            return cpu_decode.LinearWeights.int8_s8(inner.qweight, inner.scales.float().reshape(-1),
                                                    float(self.scale), zero, inner.bias)
        raise ValueError(f"no fused CPU kernel for {self.kind} static inputs over {type(inner).__name__}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(round_to_grid(x, self.scale, self.kind, self.zero_point))
