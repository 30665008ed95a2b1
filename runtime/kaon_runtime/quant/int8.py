"""Int8 weights, one symmetric scale per output channel (W8A16)."""
from __future__ import annotations

import torch

from kaon_runtime.kernels.quant_gemm_cpu import ACTIVATION_DTYPE, DENSE_ROWS, w8_dense_cpu, w8_matmul_cpu
from kaon_runtime.kernels.quant_gemm_ref import w8a16_matmul_ref
from kaon_runtime.quant.linear import ChannelScaledLinear, kernel_for

_QMAX = 127  # -128 stays unused so the range is symmetric around zero


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (int8 [N, K], float32 scales [N]); the rounding error is at most scale / 2."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / _QMAX
    qweight = torch.round(w / scales[:, None]).clamp(-_QMAX, _QMAX).to(torch.int8).contiguous()
    return qweight, scales


class Int8Linear(ChannelScaledLinear):
    quantize = staticmethod(quantize_int8)
    cpu_scales: torch.Tensor  # a buffer, declared for the type checker

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(qweight, scales, bias)
        # The CPU kernel takes its scales in the activations' dtype; not saved with the weights.
        self.register_buffer("cpu_scales", scales.to(ACTIVATION_DTYPE), persistent=False)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), K]: the dequantized rows `ids` (a tied token lookup reads the head's)."""
        return self.qweight.index_select(0, ids).float() * self.scales.index_select(0, ids).float()[:, None]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        kernel = kernel_for(x, self.reference)
        if kernel == "triton" and self.batch_invariant:  # one tile for every M (quant/invariant.py)
            from kaon_runtime.kernels import invariant_gemm
            return invariant_gemm.w8a16_linear(x, self.qweight, self.scales)
        if kernel == "triton":  # on use: CPU-only torch builds lack Triton
            from kaon_runtime.kernels import quant_gemv
            from kaon_runtime.kernels.quant_gemm import w8a16_matmul
            if quant_gemv.fits(x, "int8"):
                return quant_gemv.w8a16_gemv(x, self.qweight, self.scales)
            return w8a16_matmul(x, self.qweight, self.scales)
        if kernel == "cpu":
            if x.shape[0] >= DENSE_ROWS:
                return w8_dense_cpu(x, self.qweight, self.scales)
            return w8_matmul_cpu(x, self.qweight, self.cpu_scales)
        return w8a16_matmul_ref(x, self.qweight, self.scales)
