"""The paged KV pool: how many blocks fit, what the largest step needs beside them, and the tensor itself.

One tensor holds every layer's keys and values, [layers, 2, kv heads, blocks, block size, head
dim]; each attention layer gets views of its own slices. On CUDA the pool takes the configured
fraction of the free memory once the largest step's activations are set aside (measured by a
profiling run, as vLLM does); on CPU it takes a byte budget.
"""
from __future__ import annotations

import logging

import torch

from kaon_runtime.arith import ceil_div
from kaon_runtime.config import EngineConfig, ModelConfig
from kaon_runtime.errors import ModelLoadError
from kaon_runtime.kernels.paged_attention_ref import MAX_HEAD_SLICE
from kaon_runtime.layers.attention import AttentionMetadata, PrefillChunk
from kaon_runtime.models.decoder import DecoderForCausalLM

log = logging.getLogger(__name__)


def kv_block_bytes(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers: K and V, block_size tokens each."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * model.num_kv_heads * block_size * model.head_dim * itemsize


def num_kv_blocks(config: EngineConfig, block_bytes: int, free_device_bytes: int | None,
                  activation_bytes: int = 0) -> int:
    """How many KV blocks to allocate: the configured count, else a fraction of the free device
    memory less the activations of the largest step (measure_activation_peak), or a byte
    budget on CPU."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if free_device_bytes is None:
        budget = config.kv_cache_bytes
    else:
        budget = int(free_device_bytes * config.kv_cache_fraction) - activation_bytes
    return max(budget // block_bytes, 0)


def profile_chunks(num_tokens: int, max_len: int) -> list[int]:
    """The largest step's tokens as prefill chunks no longer than the context allows."""
    return [min(max_len, num_tokens - start) for start in range(0, num_tokens, max_len)]


def allocate_kv_cache(model: DecoderForCausalLM, config: EngineConfig, device: torch.device,
                      dtype: torch.dtype) -> torch.Tensor:
    """Size the pool for this rank's model, attach it to the model's attention layers, return it."""
    mc = model.local_config  # this rank's KV heads
    block_size = config.block_size
    block_bytes = kv_block_bytes(mc, block_size, dtype)
    free, activations = None, 0
    if device.type == "cuda" and config.num_kv_blocks is None:
        activations = measure_activation_peak(model, config, device, dtype)
        free = torch.cuda.mem_get_info(device)[0]
    blocks = min(num_kv_blocks(config, block_bytes, free, activations), MAX_HEAD_SLICE // (block_size * mc.head_dim))
    if blocks < 1:
        raise ModelLoadError(f"the KV cache budget holds no block of {block_bytes} bytes once the largest "
                             f"step's activations ({activations / 2 ** 20:.0f} MiB) are set aside; raise the "
                             "budget or lower --max-num-batched-tokens")
    cache = attach_kv_cache(model, blocks, block_size, dtype, device)
    log.info("KV cache: %d blocks of %d tokens in %s (%.1f MiB); the largest step's activations: %.1f MiB",
             blocks, block_size, str(dtype).removeprefix("torch."), blocks * block_bytes / 2 ** 20,
             activations / 2 ** 20)
    return cache


def attach_kv_cache(model: DecoderForCausalLM, blocks: int, block_size: int, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """A zeroed pool of `blocks` blocks, its slices handed to the model's attention layers."""
    mc = model.local_config
    cache = torch.zeros((mc.num_layers, 2, mc.num_kv_heads, blocks, block_size, mc.head_dim), dtype=dtype,
                        device=device)
    for i, attn in enumerate(model.attention_layers()):
        attn.k_cache, attn.v_cache = cache[i, 0], cache[i, 1]
    return cache


def detach_kv_cache(model: DecoderForCausalLM) -> None:
    """Drop the attention layers' views, so the pool they point at can be freed."""
    for attn in model.attention_layers():
        attn.k_cache = attn.v_cache = None


@torch.inference_mode()
def measure_activation_peak(model: DecoderForCausalLM, config: EngineConfig, device: torch.device,
                            dtype: torch.dtype) -> int:
    """Bytes the largest step allocates beyond the weights and its KV blocks (vLLM's profiling run).

    Runs max_num_batched_tokens dummy tokens as prefill chunks over a scratch KV cache of just
    the blocks they write, and the logits of max_num_seqs rows, then frees it all (the model is
    left without a cache). On CUDA the peak comes from the caching allocator; elsewhere the run
    only checks that the step works, 0.
    """
    max_position = model.config.max_position_embeddings
    max_len = min(config.max_model_len or max_position, max_position)
    chunks = profile_chunks(config.max_num_batched_tokens, max_len)
    block_size = config.block_size
    per_chunk = ceil_div(max(chunks), block_size)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    cache = attach_kv_cache(model, per_chunk * len(chunks), block_size, dtype, device)
    scratch = cache.numel() * cache.element_size()
    prefills, slots, positions, start = [], [], [], 0
    for i, length in enumerate(chunks):
        table = torch.arange(i * per_chunk, (i + 1) * per_chunk, device=device)
        prefills.append(PrefillChunk(start, length, length, table))
        slots.append(torch.arange(length, device=device) + i * per_chunk * block_size)
        positions.append(torch.arange(length, device=device))
        start += length
    meta = AttentionMetadata(slot_mapping=torch.cat(slots), prefills=prefills)
    hidden = model(torch.zeros(start, dtype=torch.long, device=device), torch.cat(positions), meta)
    rows = hidden[-min(config.max_num_seqs, start):]
    torch.softmax(model.compute_logits(rows), dim=-1)  # the sampler's widest tensors
    peak = 0
    if cuda:
        torch.cuda.synchronize(device)
        peak = max(torch.cuda.max_memory_allocated(device) - before - scratch, 0)
    del hidden, rows, cache
    detach_kv_cache(model)  # their views would keep the scratch cache alive
    if cuda:
        torch.cuda.empty_cache()
    return peak
