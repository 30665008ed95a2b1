"""One rank's model and KV pool on its device: turns a scheduled batch into sampled tokens.

Loading (engine.model_loader) and the pool (engine.kv_pool) are set up once here; each step
plans the batch (engine.step_plan), runs the forward pass, eagerly or from a CUDA graph
(engine.cuda_graphs), and samples (layers.sample_step).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kaon_runtime.arith import ceil_div
from kaon_runtime.config import EngineConfig
from kaon_runtime.distributed.parallel import TensorParallel
from kaon_runtime.distributed.stages import Placement
from kaon_runtime.distributed.transport import PendingLogits, StageTransport, stage_dtype
from kaon_runtime.engine import startup
from kaon_runtime.engine.cuda_graphs import DecodeGraphs, ladder
from kaon_runtime.engine.kv_pool import allocate_kv_cache
from kaon_runtime.engine.lora_pool import LoraPool
from kaon_runtime.engine.model_loader import (
    load_model,
    pick_device,
    pick_dtype,
    pick_kernels,
    pick_kv_dtype,
    use_onednn_where_it_applies,
)
from kaon_runtime.engine.pooling import pooled_rows, record_pooling
from kaon_runtime.engine.prompt_logprobs import record_prompt_logprobs, sample_rows_only
from kaon_runtime.engine.scheduler import ScheduledBatch
from kaon_runtime.engine.sequence import Sequence
from kaon_runtime.engine.step_plan import StepPlan, plan_step
from kaon_runtime.engine.step_tensors import DecodeTables, long_tensor
from kaon_runtime.layers.attention import AttentionMetadata, PrefillChunk
from kaon_runtime.layers.moe import has_quantized_experts
from kaon_runtime.layers.penalties import row_history
from kaon_runtime.layers.sample_step import RowsToSample, is_plain, sample_plain, sample_rows, seeded_generator
from kaon_runtime.loader import Checkpoint
from kaon_runtime.models.lora_targets import attach_lora
from kaon_runtime.structured.masks import apply_bitmasks
from kaon_runtime.structured.step_masks import MaskWorker


@dataclass(slots=True)
class StepTokens:
    """Per sequence that reached its end this step: the tokens it gains (kept drafts, then one sampled)."""

    seqs: list[Sequence]
    token_ids: list[list[int]]
    logprobs: list[list[dict[int, float]]] | None  # per sequence, one dict per gained token


@dataclass(slots=True)
class LaunchedStep:
    """A step whose forward pass has started (`ModelRunner.launch`) and whose tokens `finish` samples."""

    batch: ScheduledBatch
    plan: StepPlan
    seqs: list[Sequence]  # those that sample
    masks: Future | None  # their grammar masks, being filled
    logits: torch.Tensor | PendingLogits | None


class ModelRunner:
    """One rank's model and KV pool. Under tensor parallelism every rank has one, holding its
    shard; rank 0's also plans each step and hands the plan to `on_step` (the other ranks'
    pipes) before running it."""

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, show_progress: bool = True,
                 tp: TensorParallel = TensorParallel(), on_step: Callable[[StepPlan], None] | None = None):
        self.config = config
        self.model_config = checkpoint.config
        self.eos_token_ids = list(checkpoint.tokenizer.eos_token_ids)  # min_tokens holds them back
        self.tp = tp
        self.on_step = on_step
        self._pooled: list[torch.Tensor] = []  # the last step's hidden rows of embedding requests
        self.device = pick_device(config.device, tp.rank)
        self.dtype = pick_dtype(config.dtype, self.device)
        self.kv_dtype = pick_kv_dtype(config, self.dtype, self.device)
        self.block_size = config.block_size
        self.kernels = pick_kernels(config, checkpoint, self.device, self.dtype, self.kv_dtype, tp)
        with startup.phase("load"):
            self.model = load_model(config, checkpoint, self.device, self.dtype, self.kernels, tp, show_progress)
        # This rank's weights (parameters and quantized buffers), KV cache not included; counted
        # before oneDNN's reordered weights, which are opaque tensors of the same size, replace them.
        self.weight_bytes = sum(t.numel() * t.element_size()
                                for t in itertools.chain(self.model.parameters(), self.model.buffers()))
        use_onednn_where_it_applies(self.model, self.kernels, self.device, self.dtype)
        self.lora: LoraPool | None = None  # the adapters' slots, wrapped around the loaded (quantized) projections
        if config.lora_enabled:
            batch, targets = attach_lora(self.model, config.lora_slots, config.max_lora_rank, self.dtype, self.device)
            self.lora = LoraPool(self.model_config, batch, targets, config.lora_slots, config.max_lora_rank, tp)
        with startup.phase("kv_allocation"):
            self.kv_cache = allocate_kv_cache(self.model, config, self.device, self.kv_dtype)  # its stage's layers only
        # Pipeline parallelism: activations to and from the neighbouring stages, logits to the leader.
        stage = tp.stage
        self.transport = None if stage.size == 1 or tp.world is None else StageTransport(
            Placement(stage.index * tp.size + tp.rank, tp.size, stage.size), tp.world, self.model_config.hidden_size,
            self.model_config.vocab_size, stage_dtype(self.dtype, self.device), self.device)
        self.num_blocks = self.kv_cache.shape[3]  # this rank's pool; the engine schedules within the smallest
        self.decode_graphs: DecodeGraphs | None = None
        self.decode_tables = DecodeTables()  # the decode rows' block tables, kept from step to step
        # The target model's runner masks its logits by the sequences' grammars (the engine sets it).
        self.grammar_masks: MaskWorker | None = None

    @property
    def cpu_decode_step(self) -> bool:
        """Whether decode steps go through the fused C step."""
        return self.kernels.cpu_decode

    # ---- CUDA graphs -----------------------------------------------------------------

    def cuda_graphs_apply(self) -> bool:
        """Decode graphs need a GPU, the Triton backend (the torch one gathers by data-dependent masks),
        one rank (collectives inside graphs are left for later) and no quantized experts (they read the routing
        on the host)."""
        return (self.config.cuda_graph_max_batch > 0 and self.device.type == "cuda" and self.tp.size == 1
                and self.transport is None and not has_quantized_experts(self.model)
                and self.kernels.attention.name == "triton" and self.lora is None)  # slots as graph inputs: to do

    def prepare_decode_graphs(self, max_model_len: int, capture: bool = True) -> None:
        """Static buffers for decode batches up to the ladder's top, and their graphs when `capture`."""
        sizes = ladder(min(self.config.cuda_graph_max_batch, self.config.max_num_seqs))
        max_blocks = ceil_div(max_model_len, self.block_size)
        model = self.model  # not a method of the runner: the graphs would hold it in a cycle (see llm_engine)

        def logits_of_all_rows(input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
            return model.compute_logits(model(input_ids, positions, meta))

        self.decode_graphs = DecodeGraphs(logits_of_all_rows, self.device, max_blocks, sizes, capture)
        self.decode_graphs.capture_all()

    # ---- one step ----------------------------------------------------------------------

    def execute(self, batch: ScheduledBatch) -> StepTokens:
        """Run the batch; return, per sequence that reached its end, its kept drafts and a new token."""
        return self.finish(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> LaunchedStep:
        """Plan the batch and start its forward pass. Under pipeline parallelism the leader's own stage
        is done when this returns and the logits come back later, so another micro-batch can go in
        meanwhile (engine.micro_batches)."""
        plan, seqs = self._plan(batch)
        # Grammar masks are filled on a worker thread while the model runs; a step without
        # grammars starts nothing.
        masks = None if self.grammar_masks is None or all(s.grammar is None for s in seqs) else \
            self.grammar_masks.start([(s.grammar, s.draft_token_ids) for s in seqs])
        return LaunchedStep(batch, plan, seqs, masks, self._run_planned(plan))

    @torch.inference_mode()
    def finish(self, step: LaunchedStep) -> StepTokens:
        """Wait for a launched step's logits and sample its sequences' tokens."""
        plan, batch, seqs, masks = step.plan, step.batch, step.seqs, step.masks
        logits = record_prompt_logprobs(plan, batch.seqs, _arrived(step.logits))
        if plan.pool_spans:
            record_pooling(plan, batch.seqs, self._pooled)
        if not seqs:
            return StepTokens([], [], None)
        assert logits is not None, "sequences to sample come with their rows' logits"
        if masks is not None:
            step_masks = masks.result()
            apply_bitmasks(logits, step_masks.bitmask, step_masks.rows)
        return self._sample(seqs, logits)

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor | None]:
        """Run the batch; return the sequences whose chunk reached their end and their logits.

        A sequence with k drafts gets k + 1 consecutive rows: its last real token's, then each draft's.
        """
        plan, sampling_seqs = self._plan(batch)
        return sampling_seqs, sample_rows_only(plan, _arrived(self._run_planned(plan)))

    def _plan(self, batch: ScheduledBatch) -> tuple[StepPlan, list[Sequence]]:
        plan, seqs = plan_step(batch, self.block_size, self._lora_slots(batch))
        if self.lora is not None and self.tp.size > 1:
            plan.lora_loads = self.lora.loads_for_plan()  # the other ranks load the same slots
        return plan, seqs

    def _lora_slots(self, batch: ScheduledBatch) -> dict[int, int] | None:
        """The slots of the batch's adapters, loaded where they are not (LoraPool.prepare); None: none."""
        if self.lora is None or not any(s.lora_id for s in batch.seqs):
            return None
        return self.lora.prepare(batch.running_adapters)

    def _run_planned(self, plan: StepPlan) -> torch.Tensor | PendingLogits | None:
        if self.on_step is not None:
            self.on_step(plan)
        return self.run(plan)

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> torch.Tensor | PendingLogits | None:
        """One forward pass (every tensor-parallel rank runs it); logits of the sample rows (on the
        leader of a pipeline, on their way back from the last stage)."""
        graphable = plan.sample_rows and not plan.prompt_rows and not plan.pool_spans
        if self.decode_graphs is not None and graphable and self.decode_graphs.fits(plan):
            return self.decode_graphs.run(plan, self._decode_tables_cpu(plan))
        meta = AttentionMetadata(slot_mapping=self._tensor(plan.slots), num_decode_tokens=len(plan.decode_tables),
                                 prefills=[PrefillChunk(start, length, context, self._tensor(table))
                                           for start, length, context, table in plan.prefills])
        if plan.decode_tables:
            tables = self._decode_tables_cpu(plan)
            meta.decode_block_tables = tables if self.device.type == "cpu" else tables.to(self.device)
            meta.decode_context_lens = self._tensor(plan.decode_lens)
        if self.lora is not None:
            if plan.lora_loads and self.tp.rank > 0:  # rank 0 loaded them when it planned the step
                self.lora.load_from_plan(plan.lora_loads)
            self.lora.batch.set(plan.lora_slots, self.device)
        rows = plan.sample_rows + plan.prompt_rows  # prompt rows: prompt logprobs (engine/prompt_logprobs.py)
        stage, transport = self.tp.stage, self.transport
        intermediate = None if stage.is_first or transport is None else transport.recv_activations(len(plan.input_ids))
        hidden = self.model(self._tensor(plan.input_ids), self._tensor(plan.positions), meta, intermediate)
        if not stage.is_last:  # the next stage goes on; the leader gets the logits back from the last
            assert transport is not None
            transport.send_activations(hidden)
            return transport.recv_logits(len(rows)) if rows and transport.is_leader else None
        self._pooled = pooled_rows(plan, hidden)  # embedding requests' rows (engine/pooling.py); usually none
        if not rows:
            return None
        logits = self.model.compute_logits(hidden[self._tensor(rows)])
        if transport is not None:
            transport.send_logits(logits)
        return logits

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> StepTokens:
        if all(not s.draft_token_ids and is_plain(s.params) for s in seqs):
            # The common step (no drafts, logprobs, seeds or penalties): one batched call, no per-row objects.
            params = [s.params for s in seqs]
            return StepTokens(seqs, [[token] for token in sample_plain(logits, params)], None)
        rows = [RowsToSample(s.params, self.generator(s), s.draft_token_ids, s.draft_probs,
                             row_history(s.params, s.token_ids, s.num_prompt_tokens, self.eos_token_ids))
                for s in seqs]
        sampled = sample_rows(logits, rows)
        return StepTokens(seqs, sampled.token_ids, sampled.logprobs)

    def _tensor(self, values) -> torch.Tensor:
        return long_tensor(values, self.device)

    def _decode_tables_cpu(self, plan: StepPlan) -> torch.Tensor:
        """The plan's decode tables, padded, on the CPU: from the rows kept between steps where the plan names
        its sequences (plan_step's plans do), else built whole."""
        if len(plan.decode_seq_ids) == len(plan.decode_tables):
            return self.decode_tables.gather(plan.decode_seq_ids, plan.decode_tables)
        return long_tensor(plan.padded_decode_tables(), torch.device("cpu"))

    def generator(self, seq: Sequence) -> torch.Generator | None:
        """The sequence's own seeded generator, made on first use; None draws from the global RNG."""
        if seq.generator is None and seq.params.seed is not None:
            seq.generator = seeded_generator(seq.params.seed, seq.index, self.device)
        return seq.generator


def _arrived(logits: torch.Tensor | PendingLogits | None) -> torch.Tensor | None:
    return logits.wait() if isinstance(logits, PendingLogits) else logits
