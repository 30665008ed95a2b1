"""FP8 (E4M3) weights, one scale per output channel.

On a GPU, a few rows (decode; kernels/quant_gemv.py) multiply the FP8 weight as it is, in float32
(W8A16: no activation quantization, and half bfloat16's bytes read). More rows, on a GPU with FP8
tensor cores (compute capability 9.0+, for row-wise scales) and bfloat16 activations, have their
activations quantized per row on the fly for torch._scaled_mm, FP8 x FP8 (W8A8). Everywhere else
the weight is widened and multiplied in float32 (W8A16), which is also the reference the GPU paths
are compared with. On CPU the fused C step (kernels/cpu_decode.c, kind FP8) computes the same numbers
for its rows, each row summed in one order whatever the step's size (answers batch-invariant).
"""
from __future__ import annotations

import torch
from torch import nn

from kaon_runtime.kernels import cpu_decode
from kaon_runtime.quant.linear import ChannelScaledLinear, kernel_for

FP8 = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(FP8).max
_TINY = torch.finfo(torch.float32).tiny


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (float8_e4m3fn [N, K], float32 scales [N]); the largest |w| of a row maps to 448."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=_TINY) / _FP8_MAX
    return (w / scales[:, None]).clamp(-_FP8_MAX, _FP8_MAX).to(FP8), scales


def fp8_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (nn.functional.linear(x.float(), qweight.float()) * scales).to(x.dtype)


def scaled_mm_supported(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Whether torch._scaled_mm with row-wise scales can take this product."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
            and x.shape[1] % 16 == 0 and qweight.shape[0] % 16 == 0)


def fp8_matmul_scaled_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    x_scales = x.abs().amax(dim=1, keepdim=True).float().clamp(min=_TINY) / _FP8_MAX
    xq = (x / x_scales).clamp(-_FP8_MAX, _FP8_MAX).to(FP8)
    # qweight [N, K] row-major is [K, N] column-major after .t(): the layout _scaled_mm wants for mat2.
    return torch._scaled_mm(xq, qweight.t(), scale_a=x_scales, scale_b=scales[None, :], out_dtype=x.dtype)


class Fp8Linear(ChannelScaledLinear):
    quantize = staticmethod(quantize_fp8)

    def fused_cpu_weights(self, fp8_inputs: bool = False, input_scale: float | None = None
                          ) -> cpu_decode.LinearWeights:
        """This weight as the fused CPU step reads it, in place (no copy): the C kernels widen each e4m3 value
        exactly and multiply float32 activations, so a row's numbers are this matmul's on CPU, summed in one
        order whatever the row count (issue 49 §2; models/cpu_decode_step.py)."""
        return cpu_decode.LinearWeights.fp8(self.qweight, self.scales, self.bias, fp8_inputs, input_scale)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if kernel_for(x, self.reference) == "triton" and self.batch_invariant:  # weight-only for every M
            from kaon_runtime.kernels import invariant_gemm
            return invariant_gemm.fp8_linear(x, self.qweight, self.scales)
        if kernel_for(x, self.reference) == "triton":
            from kaon_runtime.kernels import quant_gemv  # on use: CPU-only torch builds lack Triton
            if quant_gemv.fits(x, "fp8"):
                return quant_gemv.fp8_gemv(x, self.qweight, self.scales)
        if scaled_mm_supported(x, self.qweight):
            return fp8_matmul_scaled_mm(x, self.qweight, self.scales)
        return fp8_matmul_ref(x, self.qweight, self.scales)
