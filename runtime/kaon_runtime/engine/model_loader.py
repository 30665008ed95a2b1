"""A rank's model, ready to run: the device and dtypes, the kernels it is built with, its weights, quantization.

Just over 300 lines for a stated reason: it is one sequence (pick the device and kernels, check the load's peak
against the memory, stream the weights, quantize as they arrive or after, release what the kernels do not read),
and its helpers each serve one step of it with the same checkpoint and settings; the decisions themselves live in
their own modules (memory_fit, gguf_weights, prequantized, quant/on_load).
"""
from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from kaon_runtime.config import EngineConfig, ModelConfig
from kaon_runtime.distributed.parallel import TensorParallel
from kaon_runtime.engine import memory_fit
from kaon_runtime.engine.gguf_weights import gguf_prequantized, gguf_table, held_linears, own_method, table_held
from kaon_runtime.engine.kv_pool import kv_block_bytes
from kaon_runtime.engine.prequantized import (
    Prequantized,
    check_requested,
    checkpoint_scheme,
    reference_arithmetic,
)
from kaon_runtime.errors import ModelDoesNotFitError, ModelLoadError
from kaon_runtime.layers.cpu_linear import onednn_linears_apply, use_onednn_linears
from kaon_runtime.layers.kernel_backend import KernelBackend, select_kernels
from kaon_runtime.layers.rows_alone import gaps as rows_alone_gaps
from kaon_runtime.loader import Checkpoint
from kaon_runtime.loader.mapped_safetensors import release_pages
from kaon_runtime.models import cpu_decode_step
from kaon_runtime.models.decoder import DecoderForCausalLM
from kaon_runtime.models.registry import build_model
from kaon_runtime.models.weights import target
from kaon_runtime.quant import quantize_model
from kaon_runtime.quant.invariant import use_batch_invariant_kernels
from kaon_runtime.quant.on_load import QuantizeOnLoad, defer, quantized_bytes, transient_bytes
from kaon_runtime.quant.pending import hold_places, hold_table
from kaon_runtime.quant.reference import use_reference_kernels
from kaon_runtime.quant.surgery import HEAD_TABLE

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def pick_device(name: str, rank: int = 0) -> torch.device:
    """The device named, or the best one there is for "auto"; tensor-parallel rank r takes GPU r."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' was asked for but no CUDA GPU is visible")
    if name == "cuda":
        return torch.device("cuda", rank)
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def pick_kv_dtype(config: EngineConfig, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype: as configured, or for "auto" float16 under int8/int4 weights on CPU
    (decode attention there reads every cached key and value once per layer and step, bound by
    memory; the narrow formats already give up float32's exact output, and docs/engine.md has
    what float16 keys and values cost in perplexity), else the model's own."""
    if config.kv_cache_dtype != "auto":
        return _DTYPES[config.kv_cache_dtype]
    if device.type == "cpu" and dtype == torch.float32 and config.quantization in ("int8", "int4"):
        return torch.float16
    return dtype


def pick_kernels(config: EngineConfig, checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype,
                 kv_dtype: torch.dtype, tp: TensorParallel) -> KernelBackend:
    """The kernel backend for this device, with the fused CPU decode step where it applies (CPU; a float32,
    float16 or bfloat16 model, its weights float in that dtype, int8 / int4 in the step's layouts or fp8; a cache
    it reads, a model it covers). Quantized weights in a float16 / bfloat16 model take it too (issue 49 §2):
    the step reads their blocks as at float32 and the model's norms, embedding rows and cache as stored, so a
    row's numbers are its own; torch's path, which they ran before, sums prompt rows by the row count. Pipeline
    stages take it too, each over its own layers (models/cpu_decode_step.py). So does `--dtype float32` on a
    quantized checkpoint (the reference mode, quant/reference.py), through the step's reference kinds."""
    cpu_decode = False
    rows_alone = device.type == "cpu" and dtype == torch.float64
    if rows_alone:
        # float64 (the tests' exactness oracle against transformers' float64): torch's path, its projections, head,
        # experts and attention through float64 kernels that compute each row alone (layers/rows_alone.py), so its
        # answers are batch invariant as the fused step's are. What they do not cover is said once here.
        gaps = rows_alone_gaps(_weights_quantization(config, checkpoint), kv_dtype, tp.size, config.lora_enabled)
        rows_alone = gaps is None
        log.info("a float64 model on CPU: torch's path, %s", "each row computed alone (batch invariant)"
                 if rows_alone else f"answers not batch invariant ({gaps})")
    if device.type == "cpu" and dtype in cpu_decode_step.DTYPES:
        reason: str | None
        if kv_dtype not in cpu_decode_step.KV_DTYPES:
            reason = f"a {str(kv_dtype).removeprefix('torch.')} KV cache"
        else:
            reason = cpu_decode_step.blocker(checkpoint.config, tp.size, _weights_quantization(config, checkpoint))
        reference = reference_arithmetic(config.dtype, checkpoint_scheme(checkpoint))
        if reason is not None:
            log.info("fused CPU decode step off for this model: %s%s", reason,
                     " (its reference arithmetic, --dtype float32, runs on torch's path)" if reference else "")
        elif reference:
            log.info("--dtype float32 on a quantized checkpoint: the fused CPU step runs its reference arithmetic "
                     "(float32 activations times the exactly dequantized weights; quant/reference.py)")
        cpu_decode = reason is None
    kernels = select_kernels(device, cpu_decode, rows_alone)
    if kernels.attention.name == "triton" and kv_dtype != dtype:
        raise ModelLoadError(f"kv_cache_dtype {str(kv_dtype).removeprefix('torch.')} needs the torch attention "
                             "backend: the Triton kernels read a cache of the model's own dtype")
    return kernels


def load_model(config: EngineConfig, checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype,
               kernels: KernelBackend, tp: TensorParallel = TensorParallel(),
               show_progress: bool = True) -> DecoderForCausalLM:
    """Build this rank's model with `kernels`, stream its weights in, quantize it if asked; eval mode."""
    model_config = checkpoint.config
    if config.max_model_len is not None and config.max_model_len < model_config.max_position_embeddings:
        # The context served is the model's context: rotary tables no longer than it, and LongRoPE
        # picks its short or long factors by it (layers.rotary).
        model_config = replace(model_config, max_position_embeddings=config.max_model_len)
    scheme = checkpoint_scheme(checkpoint)
    if scheme is not None:
        check_requested(scheme, config.quantization)
    method = own_method(config, checkpoint, device.type) or config.quantization
    with torch.device("meta"):  # no memory until the final dtype and device are known
        model = build_model(model_config, tp, kernels).to(dtype)
        # A quantized checkpoint's linears stay narrow: none of them gets float memory.
        prequantized = None if scheme is None else Prequantized.plan(model, checkpoint, scheme)
        # Nor do a GGUF's linears that keep the file's own blocks (engine/gguf_weights.py).
        held = _gguf_held(checkpoint, method, config.quantization, device, tp) if prequantized is None else set()
        held &= {name for name, module in model.named_modules() if isinstance(module, nn.Linear)}
        hold_places(model, held)
        # And a tied vocabulary table the file holds as Q8_0: those blocks are its int8 table, exactly. Also under
        # --quantization from the dequantized file (one rank, one stage): surgery would make that same int8 table
        # from the float one (quant/surgery.py), which was the float table and the int8 one side by side at the peak.
        whole = tp.size == 1 and tp.stage.size == 1 and method != "none" and prequantized is None
        table = (bool(held) or whole) and model.lm_head is not None and table_held(
            checkpoint, model_config.tie_word_embeddings, device)
        if table:
            hold_table(model.lm_head, dtype)
        # The linears quantized from float: each one as its weights arrive, so the float model never exists whole.
        # (Not those a pipeline stage takes from the GGUF's own blocks after a float load: _quantize gives them.)
        quantizing = None if method == "none" or prequantized is not None else defer(
            model, method, device, release=_return_freed_heap if device.type == "cpu" else None,
            skip=_given_after_load(model, checkpoint, method, config.quantization, device, tp) - held, head=True,
            pages=release_pages)
    if device.type == "cpu":
        _check_memory(config, checkpoint, model_config, dtype, kept_narrow=bool(held) or prequantized is not None,
                      quantizing=quantizing, table=table)
    model = model.to_empty(device=device)
    stream = checkpoint.weights() if not held and not table else _without(checkpoint, held, table)
    weights = tqdm(_released_once_copied(stream), total=checkpoint.num_tensors, desc="Loading weights",
                   unit="tensor", disable=not show_progress)
    try:
        if prequantized is not None:
            model.load_weights(prequantized.set_aside(weights))
            prequantized.install(model, device, tp)
            if reference_arithmetic(config.dtype, scheme):
                marked = use_reference_kernels(model)
                log.info("--dtype float32: %d quantized linears run the checkpoint's reference arithmetic "
                         "(float32 activations; only the activation quantization the checkpoint specifies)", marked)
        else:
            model.load_weights(weights, quantizing)
            if device.type == "cpu":
                _return_freed_heap()  # the stream's per-tensor temporaries, before quantization adds its own
        if method != "none" and prequantized is None:
            on_load = 0 if quantizing is None else len(quantizing.quantized)
            _quantize(model, method, checkpoint, device, tp, own=method != config.quantization, table=table,
                      on_load=on_load)
        if kernels.batch_invariant:
            marked = use_batch_invariant_kernels(model)
            log.info("batch-invariant GPU kernels: %d quantized linears marked (quant/invariant.py)", marked)
        model.check_kernels()
        if device.type == "cpu" and model.hold_kernel_layouts():  # each quantized weight the C step reads held once
            _return_freed_heap()
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"{checkpoint.path.name}: {exc}") from exc
    return model.eval()


def _released_once_copied(stream: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream, each tensor's file pages released (loader/mapped_safetensors.release_pages) when the next
    is asked for: by then load_weights has copied it into its parameter, or Prequantized.set_aside holds it
    unread (its pages are read, and released, at install). Without this a safetensors checkpoint's pages
    stayed resident beside their copies until the load ended (issue 49 §3)."""
    previous = None
    for name, tensor in stream:
        if previous is not None:
            release_pages(previous)
        previous = tensor
        yield name, tensor
    if previous is not None:
        release_pages(previous)


def _check_memory(config: EngineConfig, checkpoint: Checkpoint, model_config: ModelConfig, dtype: torch.dtype,
                  kept_narrow: bool, quantizing: QuantizeOnLoad | None = None, table: bool = False) -> None:
    """ModelDoesNotFit when the load's peak would pass the container's memory limit (engine/memory_fit.py);
    `quantizing`: the linears quantized as they load, counted at their quantized size plus one's transient;
    `table`: the tied vocabulary table is held as the GGUF's Q8_0 blocks (counted so, not as float twice)."""
    if checkpoint.tensor_sizes is None:
        return  # random weights: nothing stored to size
    limit = memory_fit.memory_limit()
    if limit is None:
        return
    kv_dtype = pick_kv_dtype(config, dtype, torch.device("cpu"))
    block = kv_block_bytes(model_config, config.block_size, kv_dtype)
    kv = config.num_kv_blocks * block if config.num_kv_blocks is not None else config.kv_cache_bytes
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    held_table = getattr(checkpoint, "table_size", None) if table else None
    peak = memory_fit.estimate(checkpoint.tensor_sizes(), dtype_bytes, kept_narrow, kv, memory_fit.resident_bytes(),
                               held_table=held_table)
    if quantizing is not None and quantizing.pending:
        shapes = [(item.linear.out_features, item.linear.in_features) for item in quantizing.pending.values()]
        peak = memory_fit.quantized_on_load(
            peak, float_bytes=sum(n * k * dtype_bytes for n, k in shapes),
            quantized=sum(quantized_bytes(quantizing.method, n, k, quantizing.group_size) for n, k in shapes),
            transient=max(transient_bytes(n, k, dtype_bytes) for n, k in shapes))
    peak = replace(peak, host_tier=max(config.kv_offload_bytes, 0))
    problem = memory_fit.check_fits(peak, limit)
    if problem is not None:
        raise ModelDoesNotFitError(f"{checkpoint.path.name}: {problem}")
    log.info("memory: the load peaks at about %d MiB of the container's %d MiB", peak.total >> 20, limit >> 20)


def _gguf_held(checkpoint: Checkpoint, method: str, requested: str, device: torch.device,
               tp: TensorParallel) -> set[str]:
    """The linears whose GGUF blocks _quantize will take as they are (the same rule as there)."""
    own = method != requested
    # A pipeline stage renumbers its layers as the weights stream in: it keeps the float path.
    if method == "none" or not (own or method == "int4") or tp.size != 1 or tp.stage.size > 1:
        return set()
    return held_linears(checkpoint, device, int4_only=not own)


def _given_after_load(model: DecoderForCausalLM, checkpoint: Checkpoint, method: str, requested: str,
                      device: torch.device, tp: TensorParallel) -> set[str]:
    """The linears (this stage's names) _quantize gives the GGUF's own blocks (the same rule as there)."""
    own = method != requested
    if method == "none" or not (own or method == "int4") or tp.size != 1:
        return set()
    names = held_linears(checkpoint, device, int4_only=not own)
    return {name for name, _ in model.stage_weights((name, None) for name in names)}


def _without(checkpoint: Checkpoint, held: set[str], table: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors less the held linears' weights and the held table (those are never
    dequantized where the checkpoint can skip them, and dropped here where it cannot)."""
    def skipped(name: str) -> bool:
        if table and name in ("model.embed_tokens.weight", "lm_head.weight"):
            return True
        return name.endswith(".weight") and target(name)[0].removesuffix(".weight") in held

    skipping = getattr(checkpoint, "weights_skipping", None)
    stream = checkpoint.weights() if skipping is None else skipping(skipped)
    return ((name, tensor) for name, tensor in stream if not skipped(name))


def _weights_quantization(config: EngineConfig, checkpoint: Checkpoint) -> str:
    """The linears' quantization as the fused CPU step asks: --quantization's, or a quantized checkpoint's
    own family where the step reads it as kaon's int4 / int8 (else its description, which it does not)."""
    scheme = checkpoint_scheme(checkpoint)
    if scheme is None:
        return own_method(config, checkpoint, "cpu") or config.quantization
    # --dtype float32: the step's reference kinds (cpu_decode.c REF_*), which read other layouts (act-order too)
    fused = scheme.cpu_reference_fused if reference_arithmetic(config.dtype, scheme) else scheme.cpu_fused
    return scheme.method if fused else scheme.description


def use_onednn_where_it_applies(model: nn.Module, kernels: KernelBackend, device: torch.device,
                                dtype: torch.dtype) -> None:
    """Float32 linears on CPU through oneDNN (layers.cpu_linear), unless the fused step reads them:
    it needs plain weights, and oneDNN's are opaque. Nor under the GPU's batch-invariant switch (Triton's interpreter on
    CPU): its linears are the invariant GEMM's (layers/invariant_linear.py)."""
    if not kernels.cpu_decode and not kernels.batch_invariant and onednn_linears_apply(device, dtype):
        use_onednn_linears(model)


def _quantize(model: DecoderForCausalLM, method: str, checkpoint: Checkpoint, device: torch.device,
              tp: TensorParallel, own: bool = False, table: bool = False, on_load: int = 0) -> None:
    """Swap the linear layers for quantized ones: a GGUF file's own blocks where it runs in its own
    precision (`own`), its 4-bit ones under int4 (engine/gguf_weights.py), the rest from float; `table`:
    the tied vocabulary table from the file's Q8_0 blocks; `on_load`: how many linears were quantized as they
    loaded (quant/on_load.py; what is left here is the GGUF's own blocks, the experts and the vocabulary head)."""
    given: dict[str, Any] = {}
    # The GGUF's own blocks are whole tensors; a shard is re-quantized from its float weights.
    if (own or method == "int4") and tp.size == 1:
        # Named by their global layers: a pipeline stage takes its own, renumbered as its model is.
        given = dict(model.stage_weights(gguf_prequantized(checkpoint, device, int4_only=not own).items()))
    if table:
        given[HEAD_TABLE] = gguf_table(checkpoint)
    names = set(given)  # (quantize_model takes each given weight out of `given` as its module is built)
    swapped = quantize_model(model, method, prequantized=given)
    reused = len(names & set(swapped))
    log.info("%s: %d linear layers quantized (%d as they loaded, %d kept as the GGUF file's own blocks)", method,
             len(swapped) + on_load, on_load, reused)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the float weights' memory goes back before the KV cache is sized
    else:
        _return_freed_heap()


def _return_freed_heap() -> None:
    """Hand the float weights' freed memory back to the system: glibc keeps the small tensors'
    heap pages otherwise, and the process stays as large as the float model for its life."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim, nothing lost
        pass
