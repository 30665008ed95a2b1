"""Int8 weights, one symmetric scale per output channel (W8A16)."""
from __future__ import annotations

import torch

from kaon_runtime.kernels.quant_gemm_ref import w8a16_matmul_ref
from kaon_runtime.quant.linear import ChannelScaledLinear, use_triton

_QMAX = 127  # -128 stays unused so the range is symmetric around zero


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (int8 [N, K], float32 scales [N]); the rounding error is at most scale / 2."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / _QMAX
    qweight = torch.round(w / scales[:, None]).clamp(-_QMAX, _QMAX).to(torch.int8)
    return qweight, scales


class Int8Linear(ChannelScaledLinear):
    quantize = staticmethod(quantize_int8)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x):
            from kaon_runtime.kernels.quant_gemm import w8a16_matmul  # on use: CPU-only torch builds lack Triton
            return w8a16_matmul(x, self.qweight, self.scales)
        return w8a16_matmul_ref(x, self.qweight, self.scales)
