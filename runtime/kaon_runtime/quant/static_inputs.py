"""Static activation quantization a checkpoint was calibrated with (compressed-tensors' input_activations
with `dynamic: false`, one `input_scale` per linear): each quantized linear's input is rounded to the
checkpoint's grid (FP8 e4m3, or int8 with an optional zero point) before its product, so kaon computes
what the publisher evaluated. The rounding is done in float (fake quantization): the weights' kernels
then multiply as they do for any input."""
from __future__ import annotations

import torch
from torch import nn

from kaon_runtime.kernels import cpu_decode
from kaon_runtime.quant.fp8 import Fp8Linear

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
        """The fused CPU step's FP8_STATIC kind for FP8 inputs over per-channel / per-tensor FP8 weights: each
        input row rounded to FP8 at this fixed scale as round_to_grid does (float32), then the inner weight's
        arithmetic. Other grids and weights have no kind: the step is not built for them (their scheme says so)."""
        if self.kind != "fp8" or not isinstance(self.inner, Fp8Linear):
            raise ValueError(f"no fused CPU kernel for {self.kind} static inputs over {type(self.inner).__name__}")
        return self.inner.fused_cpu_weights(input_scale=float(self.scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(round_to_grid(x, self.scale, self.kind, self.zero_point))
