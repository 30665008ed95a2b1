"""Peak and settled resident memory of loading a model, measured in a fresh process of its own.

    python tests/support/load_memory.py MODEL [LLM keyword=value ...]

prints one JSON line: {"peak": bytes, "settled": bytes, "seconds": s, "weights": bytes, "quantized": bytes,
"released": bytes, "estimate": bytes}. peak is the process's
high-water mark (VmHWM in /proc/self/status: the load, the KV pool, the first steps); settled is its
resident memory once the engine has loaded and served a short greedy request (the engine's
working size: weights in their kernel layouts, the KV pool, torch). A fresh process, because
a high-water mark never goes down: a test process that loaded anything before would hide the load's peak.
weights is what the engine's model holds (every parameter, buffer and plain tensor attribute, each storage
once), quantized the part of it in quantized linears, kv the KV pool's; released is how much resident memory
closing the engine gave back (closed, collected, the heap trimmed): what the engine really held, copies nobody
counts included (issue 49: the fused CPU step's copy of every int8 / int4 projection sat beside the module's own).
estimate is the load's peak as the engine's memory check (engine/memory_fit.py, ModelDoesNotFit) counted it, under
a limit too large to refuse anything (0: no estimate, a checkpoint without sizes).
VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss across fork and exec, so a child of a 7 GB
pytest worker reported a 7 GB "peak" (CI, stop 55); VmHWM belongs to the new address space exec makes.
"""
from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
import time
from pathlib import Path


def resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status")


def main() -> int:
    model, *options = sys.argv[1:]
    kwargs: dict = {"show_progress": False, "device": "cpu", "num_kv_blocks": 64}
    for option in options:
        key, _, value = option.partition("=")
        kwargs[key] = int(value) if value.isdigit() else value
    start = time.perf_counter()
    from kaon_runtime import LLM, SamplingParams
    from kaon_runtime.engine import memory_fit

    estimates: list[int] = []
    check_fits = memory_fit.check_fits

    def counted(peak, limit):
        estimates.append(peak.total)
        return check_fits(peak, limit)

    memory_fit.memory_limit = lambda: 1 << 59  # (below "no limit"): the check runs and sizes the load
    memory_fit.check_fits = counted
    llm = LLM(model, **kwargs)
    llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    settled = resident_bytes()
    peak = peak_resident_bytes()
    seconds = time.perf_counter() - start
    runner = llm.engine.runner
    weights, quantized = held_bytes(runner.model)
    kv = runner.kv_cache.numel() * runner.kv_cache.element_size()
    llm.close()
    del llm, runner
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    print(json.dumps({"peak": peak, "settled": settled, "seconds": seconds, "weights": weights,
                      "quantized": quantized, "kv": kv, "released": settled - resident_bytes(),
                      "estimate": max(estimates, default=0)}))
    return 0


def held_bytes(model) -> tuple[int, int]:
    """The bytes of every tensor `model` holds (each storage once), and of those in its quantized linears."""
    import torch

    from kaon_runtime.quant.linear import QuantizedLinear

    seen: dict[int, tuple[int, bool]] = {}
    for module in model.modules():
        quantized = isinstance(module, QuantizedLinear)
        for value in [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]:
            if isinstance(value, torch.Tensor) and value.numel():
                storage = value.untyped_storage()
                seen.setdefault(storage.data_ptr(), (storage.nbytes(), quantized))
    return sum(n for n, _ in seen.values()), sum(n for n, q in seen.values() if q)


if __name__ == "__main__":
    sys.exit(main())
