"""The kernels a model is built with, chosen once per device and handed to every layer at construction.

Torch's own operations are the default everywhere. The Triton attention backend brings fused
Triton kernels for the norm, rotary, SiLU-and-mul and the experts; the fused C decode step
(models.cpu_decode_step) is for float32 on CPU. Each layer takes what applies to it from the
backend when it is made, so no kernel is switched on from outside afterwards.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kaon_runtime.layers.attention import TorchAttentionBackend, TritonAttentionBackend, backend_name
from kaon_runtime.layers.rows_alone import RowsAloneAttention, experts as rows_alone_experts

# The most sequences a step may have for the fused C step to take it (and the vocabulary head's
# C kernel, for as many rows): a full batch of a decode-heavy CPU server. Wider steps go to torch.
CPU_DECODE_MAX_ROWS = 64


@dataclass(frozen=True)
class KernelBackend:
    attention: TorchAttentionBackend | TritonAttentionBackend  # one instance, shared by every layer
    rms_norm: Callable | None = None  # kernels.norm.rms_norm: plain RMSNorm (not Gemma's offset one)
    rotary: Callable | None = None  # kernels.rotary.apply_rotary, in place
    silu_and_mul: Callable | None = None  # kernels.activation.silu_and_mul
    fused_moe: Callable | None = None  # kernels.moe.fused_moe
    cpu_decode_rows: int = 0  # decode steps of up to this many sequences through the fused C step; 0: off
    # GPU kernels whose result for a row does not depend on the rows beside it (issue 49 §2):
    # fixed tiles and reduction orders, whatever the step's size. See gpu_batch_invariant.
    batch_invariant: bool = False
    # A float64 model on CPU: its projections, head, experts and attention through the float64 kernels that compute
    # each row alone (layers/rows_alone.py), so its answers are batch invariant too (issue 49 §2).
    cpu_rows_alone: bool = False

    @property
    def cpu_decode(self) -> bool:
        return self.cpu_decode_rows > 0


def gpu_batch_invariant() -> bool:
    """KAON_GPU_BATCH_INVARIANT=1 runs the GPU's batch-invariant kernels (answers that do not move with
    batch neighbours, chunking or prefix-cache hits). Opt-in until a GPU lease has measured both
    their invariance and their cost (bench/gpu/engine_check.py); the CPU is invariant without it."""
    return os.environ.get("KAON_GPU_BATCH_INVARIANT", "0") == "1"


def torch_kernels(cpu_decode: bool = False, rows_alone: bool = False) -> KernelBackend:
    """Torch everywhere; with `cpu_decode`, the fused C step for decode steps (float32 on CPU); with `rows_alone`,
    a float64 model's parts that compute each row alone (layers/rows_alone.py)."""
    if rows_alone:
        return KernelBackend(RowsAloneAttention(), fused_moe=rows_alone_experts, cpu_rows_alone=True)
    return KernelBackend(TorchAttentionBackend(), cpu_decode_rows=CPU_DECODE_MAX_ROWS if cpu_decode else 0)


def triton_kernels(cpu_decode: bool = False) -> KernelBackend:
    """The Triton attention backend and the fused Triton kernels that go with it (`cpu_decode`:
    Triton's interpreter on CPU, whose decode steps the fused C step may still take)."""
    # Imported on use: CPU-only torch builds lack Triton.
    from kaon_runtime.kernels import activation, moe, norm, rotary
    invariant = gpu_batch_invariant()
    # The norm, rotary and SiLU-and-mul kernels compute each row alone in every mode (tiles by the hidden
    # size only); attention and the experts' sum take their invariant paths (layers.attention, kernels.moe).
    return KernelBackend(TritonAttentionBackend(batch_invariant=invariant), rms_norm=norm.rms_norm,
                         rotary=rotary.apply_rotary, silu_and_mul=activation.silu_and_mul,
                         fused_moe=functools.partial(moe.fused_moe, invariant=True) if invariant else moe.fused_moe,
                         cpu_decode_rows=CPU_DECODE_MAX_ROWS if cpu_decode else 0, batch_invariant=invariant)


def select_kernels(device: torch.device, cpu_decode: bool = False, rows_alone: bool = False) -> KernelBackend:
    """Triton on CUDA devices, torch elsewhere (KAON_ATTENTION_BACKEND overrides, layers.attention);
    `cpu_decode` adds the fused C step for decode steps (the caller checks that it applies); `rows_alone` the float64
    rows-alone parts on torch's backend."""
    if backend_name(device) == "triton":
        return triton_kernels(cpu_decode)
    return torch_kernels(cpu_decode, rows_alone)
