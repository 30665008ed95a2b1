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
  host KV tier     `--kv-offload-bytes` (engine/kv_tiers.py): filled while serving, not while loading, but a
                   tier the container cannot hold gets the engine OOM-killed hours into serving instead

The limit is the process's cgroup's, the tightest on its path (cgroup v2 memory.max, or v1 memory.limit_in_bytes:
a container's, or a systemd scope's); without one nothing is refused: a shared host's free memory moves too
much to refuse on.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

_MiB = 1 << 20
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2^63


@dataclass(frozen=True, slots=True)
class LoadPeak:
    resident: int
    weights: int
    float_transient: int
    kv_cache: int
    host_tier: int = 0

    @property
    def total(self) -> int:
        return self.resident + self.weights + self.float_transient + self.kv_cache + self.host_tier


def estimate(sizes: list[tuple[int, int, bool]], dtype_bytes: int, kept_narrow: bool, kv_cache: int,
             resident: int, held_table: tuple[int, int] | None = None) -> LoadPeak:
    """The load's peak from each tensor's (elements, stored bytes, stored quantized); `kept_narrow`: the
    quantized tensors stay quantized (a GGUF in its own precision, a publisher-quantized checkpoint);
    `held_table`: (elements, stored bytes) of a tied vocabulary table taken as the file's Q8_0 blocks
    (engine/gguf_weights.table_held: never float, under --quantization too), counted as what is held."""
    weights = transient = 0
    for elements, stored, quantized in sizes:
        if held_table is not None and quantized and (elements, stored) == held_table:
            held_table = None  # (one table: a tensor of the same size and type after it is counted as stored)
            weights += held_q8_0_bytes(elements)
            transient = max(transient, stored + elements)  # its blocks read out, and repack's int8 values
            continue
        if kept_narrow and quantized:
            weights += stored
        else:
            weights += elements * dtype_bytes
            transient = max(transient, elements * 4)  # it is made float32 on its way in
    return LoadPeak(resident, weights, transient, kv_cache)


def held_q8_0_bytes(elements: int) -> int:
    """A Q8_0 tensor as kaon holds it (quant/gguf.py repack: GroupInt8Weight): an int8 a weight and a float32
    scale per 32."""
    return elements + elements // 32 * 4


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
    tier = f", the host KV tier (--kv-offload-bytes) {peak.host_tier // _MiB} MiB" if peak.host_tier else ""
    return (f"loading needs about {peak.total // _MiB} MiB at its peak (the process {peak.resident // _MiB} MiB, "
            f"weights in their kernel layout {peak.weights // _MiB} MiB, the largest tensor's float copy "
            f"{peak.float_transient // _MiB} MiB, KV cache {peak.kv_cache // _MiB} MiB{tier}) and the container's "
            f"memory limit is {limit // _MiB} MiB: give it more memory, a smaller --kv-cache-bytes"
            f"{', a smaller --kv-offload-bytes' if peak.host_tier else ''} or a narrower format")


def memory_limit() -> int | None:
    """The memory limit of this process's cgroup (the tightest on its path to the root), or None where none."""
    return limit_from(_read(Path("/proc/self/cgroup")) or "", _read)


def limit_from(own_cgroups: str, read: Callable[[Path], str | None]) -> int | None:
    """The tightest memory limit along the process's own cgroup path (`own_cgroups`: /proc/self/cgroup),
    in each mounted hierarchy: cgroup v2 (`0::/path`, memory.max) and v1's memory controller
    (`N:memory:/path`, memory.limit_in_bytes). In a container with its own cgroup namespace the path is
    "/" and this reads the mount's root, the container's own limit. Reading only the root, as this did
    until 2026-12-01, missed a limit given outside such a namespace (`systemd-run -p MemoryMax=...`, a v1
    host's scope or a container sharing the host's cgroup namespace): no check, and an OOM kill half-way
    through the load. A path that is not under the mount (a container's view of the host's path) falls back
    to the directories that exist, down to the mount's root."""
    limits = []
    for line in own_cgroups.splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        for mount, file, wanted in _HIERARCHIES:
            if controllers != wanted and wanted not in controllers.split(","):
                continue  # (v2's line has no controllers; v1's memory line may name others beside it)
            directory = mount / path.strip().lstrip("/")
            while True:
                value = _limit_value(read(directory / file))
                if value is not None:
                    limits.append(value)
                if directory == mount:
                    break
                directory = directory.parent
    return min(limits, default=None)


# (mount point, limit file, controller field of /proc/self/cgroup: "" is v2's single hierarchy)
_HIERARCHIES = ((Path("/sys/fs/cgroup"), "memory.max", ""),
                (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes", "memory"))


def _limit_value(text: str | None) -> int | None:
    if text is None or text.strip() == "max":
        return None
    try:
        value = int(text.strip())
    except ValueError:
        return None
    return None if value >= _UNLIMITED else value


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def resident_bytes() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
