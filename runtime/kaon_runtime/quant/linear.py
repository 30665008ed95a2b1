"""The shell every quantized linear shares: flatten leading dims, run its matmul, add the bias."""
from __future__ import annotations

import os

import torch
from torch import nn

_KERNEL_CHOICES = ("auto", "triton", "cpu", "torch")


def kernel_for(x: torch.Tensor, reference: bool = False) -> str:
    """Which matmul a quantized linear runs for x: "triton" on CUDA, "cpu" on CPU (kernels/quant_gemm_cpu.py:
    torch's packed-weight kernels for few rows, a dense GEMM for many), "torch" (the dequantizing
    reference) elsewhere, and always for a `reference` linear (quant/reference.py: the format's own
    arithmetic, float32 activations). KAON_QUANT_KERNEL overrides: =triton forces Triton (its
    interpreter in CPU tests), =torch the reference."""
    if reference:
        return "torch"
    choice = os.environ.get("KAON_QUANT_KERNEL", "auto")
    if choice not in _KERNEL_CHOICES:
        raise ValueError(f"KAON_QUANT_KERNEL must be one of {_KERNEL_CHOICES}, got {choice!r}")
    if choice != "auto":
        return choice
    return "triton" if x.is_cuda else "cpu" if x.device.type == "cpu" else "torch"


class QuantizedLinear(nn.Module):
    """Stands in for nn.Linear; subclasses hold the quantized weight as buffers and define matmul."""

    # True: matmul multiplies float activations by the dequantized weight, whatever the device's fast
    # kernels would do to the activations (quant/reference.py sets it for `--dtype float32`).
    reference = False
    # True: on a GPU, each row's numbers do not depend on the row count (quant/invariant.py sets it under
    # KAON_GPU_BATCH_INVARIANT=1; kernels/invariant_gemm.py).
    batch_invariant = False

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x.reshape(-1, self.in_features))
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in_features] -> [M, out_features] in x's dtype."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class ChannelScaledLinear(QuantizedLinear):
    """A quantized weight [N, K] with one float32 scale per output channel (int8, fp8)."""

    qweight: torch.Tensor  # buffers (register_buffer), declared for the type checker
    scales: torch.Tensor

    @staticmethod
    def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float [N, K] -> (quantized [N, K], scales [N]); each subclass brings its own."""
        raise NotImplementedError

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(qweight.shape[1], qweight.shape[0], bias)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> ChannelScaledLinear:
        return cls(*cls.quantize(linear.weight.detach()), linear.bias)


def mark_quantized_linears(model: nn.Module, attribute: str) -> int:
    """Set `attribute` ("reference" or "batch_invariant") on every quantized linear of `model`; how many there were."""
    marked = 0
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            setattr(module, attribute, True)
            marked += 1
    return marked
