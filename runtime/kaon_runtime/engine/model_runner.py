"""Owns the model and the KV pool on the device; turns a scheduled batch into sampled tokens."""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, replace
from typing import Callable

import torch
from tqdm.auto import tqdm

from kaon_runtime.config import EngineConfig, ModelConfig
from kaon_runtime.distributed.parallel import TensorParallel
from kaon_runtime.engine.cuda_graphs import DecodeGraphs, ladder
from kaon_runtime.engine.scheduler import ScheduledBatch
from kaon_runtime.engine.sequence import Sequence
from kaon_runtime.engine.step_plan import StepPlan, plan_step
from kaon_runtime.errors import ModelLoadError
from kaon_runtime.kernels.paged_attention_ref import MAX_HEAD_SLICE
from kaon_runtime.layers.cpu_linear import onednn_linears_apply, use_onednn_linears
from kaon_runtime.layers.attention import AttentionMetadata, PrefillChunk, select_backend
from kaon_runtime.layers.rejection import verify
from kaon_runtime.layers.sampler import SamplingBatch, logprobs_of, sample
from kaon_runtime.loader import Checkpoint
from kaon_runtime.models.cpu_decode_step import KV_DTYPES
from kaon_runtime.models.registry import build_model
from kaon_runtime.quant import quantize_model
from kaon_runtime.quant.gguf import int4_from_q4_1

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass(slots=True)
class StepTokens:
    """Per sequence that reached its end this step: the tokens it gains (kept drafts, then one sampled)."""

    seqs: list[Sequence]
    token_ids: list[list[int]]
    logprobs: list[list[dict[int, float]]] | None  # per sequence, one dict per gained token


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


def kv_block_bytes(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers: K and V, block_size tokens each."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * itemsize


def num_kv_blocks(config: EngineConfig, block_bytes: int, free_device_bytes: int | None,
                  activation_bytes: int = 0) -> int:
    """How many blocks fit the budget: a share of free GPU memory, less what the largest step
    needs for its activations (measured, see ModelRunner.measure_activation_peak), or a byte
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


class ModelRunner:
    """One rank's model and KV pool. Under tensor parallelism every rank has one, holding its
    shard; rank 0's also plans each step and hands the plan to `on_step` for the others."""

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, show_progress: bool = True,
                 tp: TensorParallel = TensorParallel()):
        self.config = config
        self.model_config = checkpoint.config
        self.tp = tp
        self.device = pick_device(config.device, tp.rank)
        self.dtype = pick_dtype(config.dtype, self.device)
        self.kv_dtype = pick_kv_dtype(config, self.dtype, self.device)
        self.block_size = config.block_size
        self.model = self._load_model(checkpoint, show_progress)
        # This rank's weights (parameters and quantized buffers), KV cache not included; counted
        # before oneDNN's reordered weights, which are opaque tensors of the same size, replace them.
        self.weight_bytes = sum(t.numel() * t.element_size()
                                for t in itertools.chain(self.model.parameters(), self.model.buffers()))
        self.cpu_decode_step = self._use_cpu_decode_step()
        if not self.cpu_decode_step and onednn_linears_apply(self.device, self.dtype):
            use_onednn_linears(self.model)  # the fused step reads plain weights; oneDNN's are opaque
        self.num_blocks = self._allocate_kv_cache()
        self.on_step: Callable[[StepPlan], None] | None = None
        self.decode_graphs: DecodeGraphs | None = None

    # ---- setup -----------------------------------------------------------------------

    def _load_model(self, checkpoint: Checkpoint, show_progress: bool):
        config = self.model_config
        if self.config.max_model_len is not None and self.config.max_model_len < config.max_position_embeddings:
            # The context served is the model's context: rotary tables no longer than it, and LongRoPE
            # picks its short or long factors by it (layers.rotary).
            config = replace(config, max_position_embeddings=self.config.max_model_len)
        with torch.device("meta"):  # no memory until the final dtype and device are known
            model = build_model(config, self.tp).to(self.dtype)
        model = model.to_empty(device=self.device)
        weights = tqdm(checkpoint.weights(), total=checkpoint.num_tensors, desc="Loading weights",
                       unit="tensor", disable=not show_progress)
        try:
            model.load_weights(weights)
            if self.config.quantization != "none":
                self._quantize(model, checkpoint)
        except (KeyError, ValueError) as exc:
            raise ModelLoadError(f"{checkpoint.path.name}: {exc}") from exc
        return model.eval()

    def _use_cpu_decode_step(self) -> bool:
        """Decode-only steps through the fused C step where it applies (float32 activations on CPU)."""
        if self.device.type != "cpu" or self.dtype != torch.float32:
            return False
        if self.kv_dtype not in KV_DTYPES:
            reason = f"a {str(self.kv_dtype).removeprefix('torch.')} KV cache"
        else:
            reason = self.model.use_cpu_decode_step()
        if reason is not None:
            log.info("fused CPU decode step off for this model: %s", reason)
        return reason is None

    def _quantize(self, model, checkpoint: Checkpoint) -> None:
        """Swap the linear layers for quantized ones; int4 takes a GGUF file's Q4_1 blocks as they are."""
        method = self.config.quantization
        given = {}
        # The GGUF's own blocks are whole tensors; a shard is re-quantized from its float weights.
        if method == "int4" and checkpoint.q4_1_blocks is not None and self.tp.size == 1:
            fused = model.fuse_rows(checkpoint.q4_1_blocks())
            given = {name.removesuffix(".weight"): int4_from_q4_1(blocks.to(self.device))
                     for name, blocks in fused.items()}
        swapped = quantize_model(model, method, prequantized=given)
        reused = len(given.keys() & set(swapped))
        log.info("%s: %d linear layers quantized (%d from the checkpoint's own Q4_1 blocks)",
                 method, len(swapped), reused)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the float weights' memory goes back before the KV cache is sized

    def _allocate_kv_cache(self) -> int:
        mc = self.model.local_config  # this rank's KV heads
        block_bytes = kv_block_bytes(mc, self.block_size, self.kv_dtype)
        backend = select_backend(self.device)
        if backend.name == "triton" and self.kv_dtype != self.dtype:
            raise ModelLoadError(f"kv_cache_dtype {str(self.kv_dtype).removeprefix('torch.')} needs the torch attention "
                                 "backend: the Triton kernels read a cache of the model's own dtype")
        if backend.name == "triton":
            self.model.use_triton_kernels()
        free, activations = None, 0
        if self.device.type == "cuda" and self.config.num_kv_blocks is None:
            activations = self.measure_activation_peak(backend)
            free = torch.cuda.mem_get_info(self.device)[0]
        blocks = min(num_kv_blocks(self.config, block_bytes, free, activations),
                     MAX_HEAD_SLICE // (self.block_size * mc.head_dim))
        if blocks < 1:
            raise ModelLoadError(f"the KV cache budget holds no block of {block_bytes} bytes once the largest "
                                 f"step's activations ({activations / 2 ** 20:.0f} MiB) are set aside; raise the "
                                 "budget or lower --max-num-batched-tokens")
        self._attach_kv_cache(blocks, backend)
        log.info("KV cache: %d blocks of %d tokens in %s (%.1f MiB); the largest step's activations: %.1f MiB",
                 blocks, self.block_size, str(self.kv_dtype).removeprefix("torch."), blocks * block_bytes / 2 ** 20,
                 activations / 2 ** 20)
        return blocks

    def _attach_kv_cache(self, blocks: int, backend) -> None:
        mc = self.model.local_config
        shape = (mc.num_layers, 2, mc.num_kv_heads, blocks, self.block_size, mc.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache, attn.backend = self.kv_cache[i, 0], self.kv_cache[i, 1], backend

    @torch.inference_mode()
    def measure_activation_peak(self, backend) -> int:
        """Bytes the largest step allocates beyond the weights and its KV blocks (vLLM's profiling run).

        Runs max_num_batched_tokens dummy tokens as prefill chunks over a scratch KV cache of just
        the blocks they write, and the logits of max_num_seqs rows, then frees it all. On CUDA the
        peak comes from the caching allocator; elsewhere the run only checks that the step works, 0.
        """
        max_len = min(self.config.max_model_len or self.model_config.max_position_embeddings,
                      self.model_config.max_position_embeddings)
        chunks = profile_chunks(self.config.max_num_batched_tokens, max_len)
        per_chunk = -(-max(chunks) // self.block_size)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
        self._attach_kv_cache(per_chunk * len(chunks), backend)
        scratch = self.kv_cache.numel() * self.kv_cache.element_size()
        prefills, slots, positions, start = [], [], [], 0
        for i, length in enumerate(chunks):
            table = torch.arange(i * per_chunk, (i + 1) * per_chunk, device=self.device)
            prefills.append(PrefillChunk(start, length, length, table))
            slots.append(torch.arange(length, device=self.device) + i * per_chunk * self.block_size)
            positions.append(torch.arange(length, device=self.device))
            start += length
        meta = AttentionMetadata(slot_mapping=torch.cat(slots), prefills=prefills)
        hidden = self.model(torch.zeros(start, dtype=torch.long, device=self.device), torch.cat(positions), meta)
        rows = hidden[-min(self.config.max_num_seqs, start):]
        torch.softmax(self.model.compute_logits(rows), dim=-1)  # the sampler's widest tensors
        peak = 0
        if cuda:
            torch.cuda.synchronize(self.device)
            peak = max(torch.cuda.max_memory_allocated(self.device) - before - scratch, 0)
        del hidden, rows
        self.kv_cache = None
        for attn in self.model.attention_layers():  # their views would keep the scratch cache alive
            attn.k_cache = attn.v_cache = None
        if cuda:
            torch.cuda.empty_cache()
        return peak

    def cuda_graphs_apply(self) -> bool:
        """Decode graphs need a GPU, the Triton backend (the torch one gathers by data-dependent masks)
        and one rank (collectives inside graphs are left for later)."""
        return (self.config.cuda_graph_max_batch > 0 and self.device.type == "cuda" and self.tp.size == 1
                and self.model.attention_layers()[0].backend.name == "triton")

    def prepare_decode_graphs(self, max_model_len: int, capture: bool = True) -> None:
        """Static buffers for decode batches up to the ladder's top, and their graphs when `capture`."""
        sizes = ladder(min(self.config.cuda_graph_max_batch, self.config.max_num_seqs))
        self.decode_graphs = DecodeGraphs(self._logits_of_all_rows, self.device, -(-max_model_len // self.block_size),
                                          sizes, capture)
        self.decode_graphs.capture_all()

    def _logits_of_all_rows(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        return self.model.compute_logits(self.model(input_ids, positions, meta))

    # ---- one step ----------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepTokens:
        """Run the batch; return, per sequence that reached its end, its kept drafts and a new token."""
        seqs, logits = self.forward(batch)
        return self._sample(seqs, logits) if seqs else StepTokens([], [], None)

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor | None]:
        """Run the batch; return the sequences whose chunk reached their end and their logits.

        A sequence with k drafts gets k + 1 consecutive rows: its last real token's, then each draft's.
        """
        plan, sampling_seqs = plan_step(batch, self.block_size)
        if self.on_step is not None:
            self.on_step(plan)
        return sampling_seqs, self.run(plan)

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> torch.Tensor | None:
        """One forward pass (every tensor-parallel rank runs it); logits of the sample rows."""
        if self.decode_graphs is not None and plan.sample_rows and self.decode_graphs.fits(plan):
            return self.decode_graphs.run(plan)
        meta = AttentionMetadata(slot_mapping=self._tensor(plan.slots), num_decode_tokens=len(plan.decode_tables),
                                 prefills=[PrefillChunk(start, length, context, self._tensor(table))
                                           for start, length, context, table in plan.prefills])
        if plan.decode_tables:
            meta.decode_block_tables = self._tensor(plan.padded_decode_tables())
            meta.decode_context_lens = self._tensor(plan.decode_lens)
        hidden = self.model(self._tensor(plan.input_ids), self._tensor(plan.positions), meta)
        if not plan.sample_rows:
            return None
        return self.model.compute_logits(hidden[self._tensor(plan.sample_rows)])

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> StepTokens:
        wanted = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
        num_logprobs = max(wanted) if wanted else None
        tokens: list[list[int]] = [[] for _ in seqs]
        logprobs = [[] for _ in seqs] if num_logprobs is not None else None
        plain, plain_rows, row = [], [], 0
        for i, seq in enumerate(seqs):
            k = len(seq.draft_token_ids)
            if k == 0:
                plain.append(i)
                plain_rows.append(row)
            else:
                rows = logits[row:row + k + 1]
                tokens[i] = verify(rows, seq.draft_token_ids, seq.draft_probs, seq.params, self.generator(seq))
                if logprobs is not None:
                    emitted = torch.tensor(tokens[i], device=logits.device)
                    logprobs[i] = logprobs_of(rows[:len(emitted)], emitted, num_logprobs)
            row += k + 1
        if plain:
            result = sample(logits[plain_rows], self._sampling_batch([seqs[i] for i in plain], num_logprobs))
            for j, i in enumerate(plain):
                tokens[i] = [result.token_ids[j]]
                if logprobs is not None:
                    logprobs[i] = [result.logprobs[j]]
        return StepTokens(seqs, tokens, logprobs)

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def generator(self, seq: Sequence) -> torch.Generator | None:
        """The sequence's own seeded generator, made on first use; None draws from the global RNG."""
        if seq.generator is None and seq.params.seed is not None:
            seq.generator = torch.Generator(device=self.device)
            # Mix in the completion index so seed s, choice 1 differs from seed s + 1, choice 0.
            seq.generator.manual_seed(hash((seq.params.seed, seq.index)) & (2 ** 63 - 1))
        return seq.generator

    def _sampling_batch(self, seqs: list[Sequence], num_logprobs: int | None) -> SamplingBatch:
        return SamplingBatch(
            temperatures=[s.params.temperature for s in seqs],
            top_ks=[s.params.top_k for s in seqs],
            top_ps=[s.params.top_p for s in seqs],
            generators=[self.generator(s) for s in seqs],
            num_logprobs=num_logprobs,
        )
