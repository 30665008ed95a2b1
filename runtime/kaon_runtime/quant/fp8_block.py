"""FP8 (E4M3) weights with one scale per block of the weight (DeepSeek's and Qwen3's 128 x 128).

The weight stays FP8 in memory. On a GPU a few rows (decode) go through kernels/quant_gemv.py, which
reads the block scales as it goes; otherwise each matmul widens the weight with its block scales, in
float32 on CPU and in the activations' dtype elsewhere (W8A16). For many rows on a GPU, torch._scaled_mm's
block-wise scaling is the next step. On CPU the fused C step (kernels/cpu_decode.c, kind FP8_BLOCK) computes
the same widened weights and products, each row summed in one order whatever the step's size (issue 49 §2),
with a checkpoint's static FP8 input scale too (StaticInputLinear over this: each input rounded first).
"""
from __future__ import annotations

import torch

from kaon_runtime.kernels import cpu_decode
from kaon_runtime.quant.linear import QuantizedLinear, kernel_for


def dequantize_fp8_blocks(qweight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float8 [N, K] with scales [ceil(N / block[0]), ceil(K / block[1])] -> float32 [N, K]."""
    n, k = qweight.shape
    full = scales.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:n, :k]
    return qweight.float() * full


class Fp8BlockLinear(QuantizedLinear):
    qweight: torch.Tensor  # buffers (register_buffer), declared for the type checker
    scales: torch.Tensor

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int],
                 bias: torch.Tensor | None = None):
        super().__init__(qweight.shape[1], qweight.shape[0], bias)
        self.block = block
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)

    def fused_cpu_weights(self, input_scale: float | None = None) -> cpu_decode.LinearWeights:
        """This weight as the fused CPU step reads it, in place: each e4m3 value widened exactly and times its
        block's scale in float32 (dequantize_fp8_blocks' products), float32 activations (W8A16); input_scale:
        each input first rounded to FP8 at that fixed scale (a static input grid: quant/static_inputs.py)."""
        return cpu_decode.LinearWeights.fp8_block(self.qweight, self.scales, self.block, self.bias, input_scale)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if kernel_for(x, self.reference) == "triton" and self.batch_invariant:  # quant/invariant.py
            from kaon_runtime.kernels import invariant_gemm
            return invariant_gemm.fp8_block_linear(x, self.qweight, self.scales, self.block)
        if kernel_for(x, self.reference) == "triton":
            from kaon_runtime.kernels import quant_gemv  # on use: CPU-only torch builds lack Triton
            if quant_gemv.fits(x, "fp8_block") and self.block[1] % quant_gemv.TILES["fp8_block"].vec == 0:
                return quant_gemv.fp8_block_gemv(x, self.qweight, self.scales, self.block)
        compute = torch.float32 if x.device.type == "cpu" else x.dtype
        weight = dequantize_fp8_blocks(self.qweight, self.scales, self.block).to(compute)
        return torch.nn.functional.linear(x.to(compute), weight).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, block={self.block}"
