"""Whether a model's load fits the memory the engine may use, counted at the load's peak (issue 49 §3).

Refused before any weight is read, with ModelDoesNotFit (`kaon serve` prints "model does not fit: ...",
which the operator turns into the condition): an engine that would be OOM-killed half-way through its load
restarts forever instead. The peak is estimated from the checkpoint's headers:

  resident         what the process holds now (Python, torch, kaon)
  weights          every tensor in the layout the engine keeps: a quantized tensor kept narrow at its stored
                   size (GGUF blocks, AWQ / GPTQ / compressed-tensors integers, FP8), the rest in the model's
                   dtype; everything in the model's dtype when it is dequantized or quantized from float
                   (`--quantization` on a float checkpoint: `quantized_on_load` then counts the linears at their
                   quantized size, since each is quantized as it loads, quant/on_load.py). Counted once because
                   it is held once: the fused CPU step reads the modules' own buffers (quant/kernel_layout.py;
                   until 2026-11-30 it kept its own copy of every int8 / int4 projection, which this missed)
  float transient  the largest tensor that passes through float on its way in (one at a time: quant/pending.py,
                   loader/gguf_file.py keep it to one); under `--quantization`, plus the largest linear's float
                   weight and its quantization's temporaries
  KV cache         the pool the engine allocates on CPU

The limit is the container's (cgroup v2 memory.max, or v1 memory.limit_in_bytes); without one nothing is
refused: a shared host's free memory moves too much to refuse on.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

_MiB = 1 << 20
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2^63
_LIMIT_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


@dataclass(frozen=True, slots=True)
class LoadPeak:
    resident: int
    weights: int
    float_transient: int
    kv_cache: int

    @property
    def total(self) -> int:
        return self.resident + self.weights + self.float_transient + self.kv_cache


def estimate(sizes: list[tuple[int, int, bool]], dtype_bytes: int, kept_narrow: bool, kv_cache: int,
             resident: int) -> LoadPeak:
    """The load's peak from each tensor's (elements, stored bytes, stored quantized); `kept_narrow`: the
    quantized tensors stay quantized (a GGUF in its own precision, a publisher-quantized checkpoint)."""
    weights = transient = 0
    for elements, stored, quantized in sizes:
        if kept_narrow and quantized:
            weights += stored
        else:
            weights += elements * dtype_bytes
            transient = max(transient, elements * 4)  # it is made float32 on its way in
    return LoadPeak(resident, weights, transient, kv_cache)


def quantized_on_load(peak: LoadPeak, float_bytes: int, quantized: int, transient: int) -> LoadPeak:
    """`peak` (from `estimate`, which counts every float-checkpoint weight in the model's dtype) when linears of
    `float_bytes` are quantized as they load (quant/on_load.py) to `quantized` bytes: only their quantized layout
    stays, and one linear at a time passes through float beside the file's tensor (`transient`: its float weight
    and its quantization's temporaries)."""
    return replace(peak, weights=peak.weights - float_bytes + quantized,
                   float_transient=peak.float_transient + transient)


def check_fits(peak: LoadPeak, limit: int | None) -> str | None:
    """Why the load does not fit under `limit` bytes, or None when it does (or there is no limit)."""
    if limit is None or peak.total <= limit:
        return None
    return (f"loading needs about {peak.total // _MiB} MiB at its peak (the process {peak.resident // _MiB} MiB, "
            f"weights in their kernel layout {peak.weights // _MiB} MiB, the largest tensor's float copy "
            f"{peak.float_transient // _MiB} MiB, KV cache {peak.kv_cache // _MiB} MiB) and the container's memory "
            f"limit is {limit // _MiB} MiB: give it more memory, a smaller --kv-cache-bytes or a narrower format")


def memory_limit() -> int | None:
    """The container's memory limit in bytes, or None where there is none."""
    for name in _LIMIT_FILES:
        try:
            text = Path(name).read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            value = int(text)
        except ValueError:
            continue
        return None if value >= _UNLIMITED else value
    return None


def resident_bytes() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
