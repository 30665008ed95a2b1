"""Sleep and wake: an idle engine gives its memory back without ending its process (vLLM's sleep mode).

Level 1 frees the KV pool (its cached prefixes go with it); on a GPU the weights are copied to host
memory too, so the device holds next to nothing, and copied back on wake. On CPU the weights stay
where they are: there is no faster memory to move them out of. Level 2 frees the weights as well:
they are first written, as they are in memory (converted and quantized already), to a file on the
node's disk, and a wake reads them back, from the page cache while the node has the memory to spare,
else from the disk: no download, no checkpoint parsing, no conversion.

Waking allocates a pool of the size it had, so the engine schedules as before, and the answers
after waking equal those before (tests/integration/test_sleep_serve.py checks it on a real server).

These functions run on the engine thread (AsyncEngine.call), between steps, with no request
running: `put_to_sleep` aborts what is left, the server having waited for it first.
"""
from __future__ import annotations

import ctypes
import gc
import logging
import os
import tempfile
import weakref
from dataclasses import dataclass, field

import torch

from kaon_runtime.engine.kv_pool import attach_kv_cache, detach_kv_cache
from kaon_runtime.engine.llm_engine import LLMEngine
from kaon_runtime.engine.model_loader import load_model, use_onednn_where_it_applies
from kaon_runtime.errors import EngineDeadError, InvalidRequestError
from kaon_runtime.loader import open_checkpoint

log = logging.getLogger(__name__)

LEVELS = (1, 2)


class EngineAsleepError(EngineDeadError):
    """The engine is asleep: a request reached it anyway (the server answers 503 and the router retries)."""

    code = "engine_asleep"


@dataclass(slots=True)
class Spill:
    """The weights written out at level 2: the file, and the tensors to fill from it in order."""

    path: str
    """Where the wake reads it: /proc/self/fd/N of an open descriptor of the file, whose name is gone already (a
    process that dies asleep leaves no file behind), or the file's own path where /proc is not there."""
    tensors: list[torch.Tensor]
    fd: int | None = None


@dataclass(slots=True)
class Sleep:
    """What a sleeping engine set aside, to put back on wake."""

    level: int
    kv_blocks: int
    host_weights: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (device tensor, copy)
    spill: Spill | None = None  # level 2: where the weights were written


def unsupported(engine: LLMEngine, level: int) -> str | None:
    """Why this engine cannot sleep at `level` (None: it can). Checked before anything is freed."""
    if level not in LEVELS:
        return f"level must be 1 or 2, got {level}"
    if engine.workers is not None:
        return "sleep is not supported with tensor or pipeline parallelism (the other ranks keep their memory)"
    if engine.drafter is not None and hasattr(engine.drafter, "runner"):
        return "sleep is not supported with a draft model (--speculative-method draft)"
    if level == 2 and engine.runner.lora is not None:
        return "sleep level 2 is not supported with LoRA adapters (their slots wrap the weights); use level 1"
    return None


def put_to_sleep(engine: LLMEngine, level: int, spill_dir: str | None = None) -> Sleep:
    """Abort what is left, forget the cached prefixes, free the KV pool (level 1) and the weights (level 2;
    written first to a file in `spill_dir`, default $TMPDIR, on the node's disk)."""
    problem = unsupported(engine, level)
    if problem is not None:
        raise InvalidRequestError(problem)
    for request_id in list(engine._requests):
        engine.abort_request(request_id)
    engine.block_manager.reset_prefix_cache()  # the blocks' contents are gone with the pool
    runner = engine.runner
    slept = Sleep(level, runner.num_blocks)
    pool = weakref.ref(runner.kv_cache)
    detach_kv_cache(runner.model)
    runner.kv_cache = None  # type: ignore[assignment]  # asleep: no pool until wake_up attaches one
    runner.decode_graphs = None  # captured over the pool's and the weights' addresses
    _forget_fused_step(runner.model)
    if level == 2:
        slept.spill = _spill(runner.model, spill_dir)
    elif runner.device.type == "cuda":
        slept.host_weights = _offload(runner.model)
    _give_back_memory(runner.device)
    if pool() is not None:  # a new holder of the pool (a feature added later) would keep its memory
        log.warning("asleep, but something still holds the KV pool: its memory is not freed")
    log.info("asleep at level %d: KV pool freed%s", level,
             {1: " (weights in host memory)" if slept.host_weights else "", 2: ", weights freed"}[level])
    return slept


def wake_up(engine: LLMEngine, slept: Sleep) -> None:
    """Put back what `put_to_sleep` freed: the weights (read back at level 2), then a pool of the same size."""
    runner, config = engine.runner, engine.config
    if slept.spill is not None:
        _unspill(runner.model, slept.spill)
    elif slept.level == 2:  # the weights could not be written out: load them again from the checkpoint
        model = load_model(config, open_checkpoint(config.model), runner.device, runner.dtype, runner.kernels,
                           runner.tp, show_progress=False)
        use_onednn_where_it_applies(model, runner.kernels, runner.device, runner.dtype)
        runner.model = model
    for tensor, host in slept.host_weights:
        tensor.data = host.to(tensor.device)
    slept.host_weights = []
    runner.kv_cache = attach_kv_cache(runner.model, slept.kv_blocks, config.block_size, runner.kv_dtype,
                                      runner.device)
    if runner.cuda_graphs_apply():
        runner.prepare_decode_graphs(engine.max_model_len)
    log.info("awake (from level %d)", slept.level)


def _forget_fused_step(model: torch.nn.Module) -> None:
    """The fused CPU decode step and the vocabulary head keep C structs that point at the weights (and the pool),
    and copies (the norms, the head's layout): dropped, so the memory goes now and they are built again on next use."""
    fused = getattr(getattr(model, "model", None), "cpu_decode", None)
    if fused is not None:
        fused._built = None
    for module in model.modules():  # the vocabulary head's own struct (layers/vocab.py), which holds its weights
        forget = getattr(module, "forget_cpu_weights", None)
        if forget is not None:
            forget()


def _tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every tensor the model holds: parameters, buffers and plain tensor attributes (packed or quantized
    weights), each once. Their storage is swapped in place (`.data`), so whoever holds one sees the change."""
    seen: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for value in [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]:
            if isinstance(value, torch.Tensor) and value.numel():
                seen.setdefault(id(value), value)
    return list(seen.values())


def _offload(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copy every tensor to pinned host memory and leave the device tensor empty."""
    moved = []
    for tensor in _tensors(model):
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
        host.copy_(tensor.data)
        tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        moved.append((tensor, host))
    return moved


def _spill(model: torch.nn.Module, spill_dir: str | None) -> Spill | None:
    """Write the weights as they are in memory (converted, quantized, packed) to a file and free them, so a
    wake reads them back from the page cache without converting anything. None when a tensor cannot be
    written (an opaque oneDNN layout): the wake then loads the checkpoint again (slower, same answers)."""
    tensors = _tensors(model)
    if any(t.layout != torch.strided for t in tensors):
        return None
    fd, path = tempfile.mkstemp(prefix="kaon-sleep-", suffix=".pt", dir=spill_dir)
    os.close(fd)
    try:
        torch.save([t.detach().cpu() for t in tensors], path)
    except BaseException:
        os.unlink(path)
        raise
    for tensor in tensors:
        tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    fd = os.open(path, os.O_RDONLY)
    if os.path.exists(f"/proc/self/fd/{fd}"):  # Linux: read back through the descriptor, the name gone now
        os.unlink(path)
        return Spill(f"/proc/self/fd/{fd}", tensors, fd)
    os.close(fd)
    return Spill(path, tensors)


def _unspill(model: torch.nn.Module, spill: Spill) -> None:
    """Map the file back in: each tensor reads its pages from the page cache as it is first used (no copy,
    so the wake itself is quick). The pages stay valid while they are mapped, the file's name gone already."""
    try:
        saved = torch.load(spill.path, mmap=True, weights_only=True)
        for tensor, value in zip(spill.tensors, saved, strict=True):
            tensor.data = value if tensor.device.type == "cpu" else value.to(tensor.device)
    finally:
        if spill.fd is not None:
            os.close(spill.fd)  # the mapping keeps the file's pages; the file goes with the last mapping
        else:
            os.unlink(spill.path)


def _give_back_memory(device: torch.device) -> None:
    """Return what was freed to the device or the system: allocators keep freed memory otherwise."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass
