"""The engine loop: validate and queue requests; each step schedules, runs the model, post-processes.

Over 300 lines for a stated reason: a request's validation (prompt, sampling, grammar, LoRA adapter)
sits beside the loop that queues it, so what the engine accepts and what it runs read together.
"""
from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kaon_runtime.config import EngineConfig
from kaon_runtime.distributed.parallel import TensorParallel
from kaon_runtime.engine import startup
from kaon_runtime.engine.admission import queue_expired
from kaon_runtime.engine.bad_words import bad_words_token_ids
from kaon_runtime.engine.block_hash import hasher_from_env
from kaon_runtime.engine.block_manager import BlockManager
from kaon_runtime.engine.draft_model import DraftModelDrafter
from kaon_runtime.engine.drafter import Drafter, NgramDrafter, draft_limit
from kaon_runtime.engine.embed_input import check_length, kept_tokens
from kaon_runtime.engine.kv_observer import attach_kv_observer
from kaon_runtime.engine.kv_tiers import TierStats
from kaon_runtime.engine.kv_transfer import ImportedKv, KvExports, adopt_reserved, place_imported, release_reserved
from kaon_runtime.engine.lora_pool import LoraPool
from kaon_runtime.engine.micro_batches import InFlight, pipeline_depth, without_finished
from kaon_runtime.engine.model_loader import pick_device
from kaon_runtime.engine.model_runner import ModelRunner
from kaon_runtime.engine.outputs import CompletionOutput, RequestOutput
from kaon_runtime.engine.pipeline_group import PipelineGroup, uses_pipeline, world_rendezvous
from kaon_runtime.engine.prompt_logprobs import prompt_logprobs_list
from kaon_runtime.engine.scheduler import Scheduler
from kaon_runtime.engine.sequence import Sequence, SequenceStatus
from kaon_runtime.engine.stop_strings import find_stop
from kaon_runtime.engine.workers import WorkerPool, check_devices, check_pipeline
from kaon_runtime.errors import EngineDeadError, InvalidRequestError
from kaon_runtime.loader import Checkpoint, open_checkpoint
from kaon_runtime.loader.tokenizer import IncrementalDetokenizer
from kaon_runtime.sampling import SamplingParams
from kaon_runtime.structured.grammars import Grammars
from kaon_runtime.structured.step_masks import MaskWorker


@dataclass(slots=True, eq=False)
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    texts: dict[int, IncrementalDetokenizer] = field(default_factory=dict)  # by seq index
    pending_forks: int = 0  # n > 1: siblings forked from the first once its prompt is in the cache
    lora_id: int = 0  # its LoRA adapter (engine.lora_pool's id); 0: the base model
    arrival: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    spec_draft_tokens: int = 0  # drafted tokens the target verified
    spec_accepted_tokens: int = 0  # of those, how many it kept
    kv_cache_tokens: int = 0  # the KV cache's size in tokens (blocks x block size)
    kv_tiers: TierStats | None = None  # the host/disk tiers' counters; None without tiers
    prompt_tokens_waiting: int = 0  # prompt tokens not computed yet, waiting or mid-prefill: a prefill pool's queue


class LLMEngine:
    def __init__(self, config: EngineConfig, show_progress: bool = True):
        self.config = config
        startup.engine_starting()  # the start-up breakdown (engine/startup.py)
        with startup.phase("load"):
            checkpoint = open_checkpoint(config.model)
        self.model_config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.workers = _start_workers(config, checkpoint)
        # However the engine ends (close, an error at start, garbage collection) its workers stop and its
        # process groups are released: the callback holds the workers, never the engine.
        self._release = weakref.finalize(self, _stop_workers, self.workers)
        self.closed = False
        try:
            tp = TensorParallel(0, config.tensor_parallel_size) if self.workers is None else self.workers.tp
            self.runner = ModelRunner(config, checkpoint, show_progress, tp,
                                      on_step=None if self.workers is None else self.workers.send)
            # The blocks every rank holds: rank 0 schedules within the smallest pool.
            self.num_blocks = self.runner.num_blocks
            if self.workers is not None:
                reports = self.workers.wait_ready()
                self.num_blocks = min([self.num_blocks] + [r.num_blocks for r in reports])
                self.worker_weight_bytes = [r.weight_bytes for r in reports]
        except BaseException:
            self.close()
            raise
        capacity = self.num_blocks * config.block_size
        # A sequence must always fit the pool on its own, or it could never finish.
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings, capacity)
        if self.runner.cuda_graphs_apply():
            with startup.phase("warmup"):
                self.runner.prepare_decode_graphs(self.max_model_len)
        self.block_manager = BlockManager(self.num_blocks, config.block_size, config.enable_prefix_caching,
                                          hasher_from_env(config.prefix_caching_hash_algo))
        try:  # KV events and the tiers below the pool; None: neither asked for
            self.kv_observer = attach_kv_observer(config, self.block_manager, self._pool_reader(), config.model,
                                                  checkpoint.path, self._lora_namer())
        except BaseException:
            self.close()
            raise
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   prefill_delay_s=config.prefill_delay_ms / 1000, max_loras=config.lora_slots,
                                   max_model_len=self.max_model_len, prefill_group=config.prefill_group)
        for name, path in (config.lora_modules or {}).items():
            self.add_lora(name, path)
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size)
        self.runner.grammar_masks = MaskWorker(self.model_config.vocab_size)
        self.drafter = _build_drafter(config, self.runner, self.num_blocks, show_progress)
        depth = pipeline_depth(config, self.drafter is not None)
        self.in_flight = InFlight(depth) if depth > 1 else None  # pipeline stages overlap (engine.micro_batches)
        self._requests: dict[str, _Request] = {}
        # Disaggregation (engine.kv_transfer): K/V leaving for decode engines; received K/V that no longer fit.
        self.kv_exports = KvExports(self._pool_reader(), config.block_size)
        self.kv_imports_evicted = 0
        self._seq_ids = itertools.count()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._draft_tokens = 0
        self._accepted_tokens = 0

    # ---- requests ----------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    adapter: str | None = None) -> None:
        """Validate a request and queue it (with the LoRA adapter of that name, None: the base model);
        raises InvalidRequestError, or ModelNotFoundError for an unknown adapter."""
        if request_id in self._requests:  # before the tokenizer's work
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self.add_validated(request_id, self.validate(prompt, params), params,
                           prompt if isinstance(prompt, str) else None, self.lora_id(adapter))

    def add_validated(self, request_id: str, token_ids: list[int], params: SamplingParams,
                      prompt: str | None = None, lora_id: int = 0, kv: ImportedKv | None = None) -> None:
        """Queue a request that `validate` accepted, without checking it again (the server validates
        off the engine thread, so the engine loop never tokenizes); `kv`: its prompt's K/V, computed by a
        prefill engine."""
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        request = _Request(request_id, prompt, token_ids, params, pending_forks=params.n - 1, lora_id=lora_id)
        self._requests[request_id] = request
        self._add_sequence(request, list(token_ids), index=0, kv=kv)
        self._prompt_tokens += len(token_ids)

    def discard_imported(self, kv: ImportedKv | None) -> None:
        """A received prompt's K/V whose request never joined: give back the blocks it holds (if any)."""
        if kv is not None and kv.reservation is not None:
            release_reserved(self.block_manager, kv.reservation)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its KV blocks return to the pool at once. Unknown ids are ignored."""
        self.kv_exports.drop(request_id)
        request = self._requests.pop(request_id, None)
        if request is not None:
            for seq in request.seqs:
                self._retire(seq, "abort")

    def expire_waiting(self, max_wait_s: float, now: float | None = None, keep: frozenset[str] = frozenset()
                       ) -> list[str]:
        """Abort the requests that have waited longer than `max_wait_s` without a token computed for them
        (engine.admission: the admission limit); their ids. A request that has started is never expired, nor
        one in `keep` (a batch's prompts, admitted together)."""
        now = time.monotonic() if now is None else now
        expired = [r.request_id for r in self._requests.values()
                   if r.seqs and r.request_id not in keep and queue_expired(now - r.arrival, max_wait_s)
                   and not any(map(_started, r.seqs))]
        for request_id in expired:
            self.abort_request(request_id)
        return expired

    # ---- LoRA adapters -----------------------------------------------------------------

    def add_lora(self, name: str, path: str, source: str | None = None) -> None:
        """Register a PEFT adapter directory under `name` (`source`: the URI it was downloaded from, which
        lora_adapters reports); raises InvalidRequestError (why it does not fit)."""
        self._lora_pool().add(name, path, source)

    def remove_lora(self, name: str) -> None:
        """Unregister an adapter (ModelNotFoundError if unknown); requests running with it finish."""
        self._lora_pool().remove(name)

    def lora_adapters(self) -> list[tuple[str, str]]:
        """(name, directory or the URI it came from) of every registered adapter."""
        return [] if self.runner.lora is None else self.runner.lora.listing()

    def lora_id(self, adapter: str | None) -> int:
        """The id add_validated takes for an adapter's name (None: 0, the base); ModelNotFoundError if unknown."""
        return 0 if adapter is None else self._lora_pool().id_of(adapter)

    def _lora_pool(self) -> LoraPool:
        if self.runner.lora is None:
            raise InvalidRequestError("LoRA adapters are off: start the engine with adapters or max_loras > 0")
        return self.runner.lora

    def _lora_namer(self) -> Callable[[int], str | None]:
        """An adapter's name by its id, for the KV events; through a weak reference, as _pool_reader says why."""
        engine = weakref.ref(self)

        def name(lora_id: int) -> str | None:
            alive = engine()
            lora = None if alive is None else alive.runner.lora
            adapter = None if lora is None else lora.adapters.get(lora_id)
            return None if adapter is None else adapter.name

        return name

    def _pool_reader(self) -> Callable[[], torch.Tensor]:
        """The KV pool as it is now (sleep frees and re-makes it), read through a weak reference to the engine:
        a callback holding the engine or its runner would keep the model and the pool alive, after close()
        or until Python's cycle collector happened to run (on a GPU, the next engine then finds no memory)."""
        engine = weakref.ref(self)

        def pool() -> torch.Tensor:
            alive = engine()
            if alive is None or alive.closed:
                raise RuntimeError("the engine is closed: its KV pool is gone")
            return alive.runner.kv_cache

        return pool

    def close(self) -> None:
        """Stop the workers, if any, release the process groups, and drop the model and its KV cache.
        The engine cannot step afterwards; closing twice is harmless."""
        self._release()
        observer = getattr(self, "kv_observer", None)  # None: never built (a failed start), or closed
        if observer is not None:
            observer.close()
            self.kv_observer = None
        if self.closed:
            return
        self.closed = True
        runner = getattr(self, "runner", None)  # absent when the start failed before it
        if runner is not None and runner.grammar_masks is not None:
            runner.grammar_masks.close()
        for heavy in ("runner", "drafter"):  # the weights and the KV cache (the draft model's too)
            if hasattr(self, heavy):
                delattr(self, heavy)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), bm.usage, bm.prefix_queries,
                           bm.prefix_hits, self.scheduler.num_preemptions, self._prompt_tokens,
                           self._generation_tokens, self._draft_tokens, self._accepted_tokens,
                           self.num_blocks * self.config.block_size,
                           self.kv_observer.tier_stats() if self.kv_observer is not None else None,
                           sum(max(0, seq.num_prompt_tokens - seq.num_computed_tokens)
                               for queue in (self.scheduler.waiting, self.scheduler.running) for seq in queue))

    # ---- the step ----------------------------------------------------------------------

    def step(self, only_finished: bool = False) -> list[RequestOutput]:
        """One forward pass over a batch; returns the requests that progressed or finished (`only_finished`:
        those that finished: an output copies its token lists, O(length) a step for each running request,
        which a caller that keeps only the last, as LLM.generate does, need not pay)."""
        if self.closed:
            raise EngineDeadError("the engine was closed")
        if self.workers is not None and self.workers.lost:
            raise EngineDeadError(self.workers.lost)
        if self.drafter is not None:
            self._propose_drafts()
        if self.runner.lora is not None and self.runner.lora.retired:
            self.runner.lora.drop_retired({r.lora_id for r in self._requests.values()})
        if self.in_flight is None:
            batch = self.scheduler.schedule()
            if not batch:
                return []
            result = self.runner.execute(batch)
        else:
            self.in_flight.fill(self.scheduler, self.runner)
            if not self.in_flight:
                return []
            launched = self.in_flight.pop()
            result = self.runner.finish(launched)
            batch = without_finished(launched.batch)
        self.scheduler.update(batch)
        if self.kv_exports:  # before _accept, which may finish a sequence and free its blocks
            self.kv_exports.after_step(batch)
        touched: dict[str, _Request] = {}
        for row, seq in enumerate(result.seqs):
            if seq.status is SequenceStatus.FINISHED:
                continue  # aborted while its micro-batch was in flight
            request = self._requests[seq.request_id]
            touched[request.request_id] = request
            if request.pending_forks and seq.index == 0:
                self._fork_siblings(request, seq)
            self._accept(request, seq, result.token_ids[row],
                         result.logprobs[row] if result.logprobs is not None else None)
        outputs = [self._output(r) for r in touched.values() if not only_finished or _finished(r)]
        for output in outputs:
            if output.finished:
                del self._requests[output.request_id]
        return outputs

    def _propose_drafts(self) -> None:
        assert self.drafter is not None
        seqs = [seq for seq in self.scheduler.running if seq.is_decoding]
        limits = [draft_limit(seq, self.config.num_speculative_tokens, self.max_model_len) for seq in seqs]
        for seq, draft in zip(seqs, self.drafter.propose(seqs, limits)):
            self.scheduler.attach_drafts(seq, draft.token_ids, draft.probs)

    def _accept(self, request: _Request, seq: Sequence, tokens: list[int], logprobs: list | None) -> None:
        """Hand the kept drafts and the sampled token to the scheduler, up to the first whose text ends
        the sequence; the scheduler adds the length stop."""
        if seq.params.max_tokens == 0:  # scoring the prompt only: the prefill's token is not kept (length stop)
            self.scheduler.accept(seq, [])
            return
        self._draft_tokens += len(seq.draft_token_ids)
        self._accepted_tokens += len(tokens) - 1
        detok = request.texts[seq.index]
        reason, complete = None, False
        for i, token in enumerate(tokens):
            before = len(detok.text)
            if seq.params.detokenize:  # vLLM's detokenize=False: token ids only, the text stays empty
                detok.add(token)
            complete = seq.grammar is not None and seq.grammar.advance(token)  # nothing may follow
            reason = self._stop_reason(seq, token, detok, before, seq.num_tokens + i + 1)
            if reason is not None or complete:
                tokens = tokens[:i + 1]
                break
        self._generation_tokens += len(tokens)
        self.scheduler.accept(seq, tokens, logprobs[:len(tokens)] if logprobs is not None else None, reason, complete)
        if seq.is_finished and self.drafter is not None:
            self.drafter.forget(seq)

    def _retire(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        if self.drafter is not None:
            self.drafter.forget(seq)

    def _stop_reason(self, seq: Sequence, token: int, detok: IncrementalDetokenizer, before: int,
                     num_tokens: int) -> str | None:
        """"stop" if `token`, the sequence's `num_tokens`-th, ends it by what it says (an EOS, a stop
        token, the end of a stop string, which is cut off the text), else None. Its length is the
        scheduler's to stop."""
        params = seq.params
        # Before min_tokens nothing but the length ends it (the sampler holds EOS and stop ids back).
        may_stop = num_tokens - seq.num_prompt_tokens >= params.min_tokens
        if may_stop and not params.ignore_eos and token in self.tokenizer.eos_token_ids:
            return "stop"
        if may_stop and token in params.stop_token_ids:
            return "stop"
        found = find_stop(detok.text, before, params.stop) if may_stop and len(detok.text) > before else None
        if found is not None:
            start, end = found
            detok.text = detok.text[:end if params.include_stop_str_in_output else start]
            return "stop"
        return None

    def _fork_siblings(self, request: _Request, first: Sequence) -> None:
        for index in range(1, request.pending_forks + 1):
            self._add_sequence(request, list(request.prompt_token_ids), index, parent=first)
        request.pending_forks = 0

    def _add_sequence(self, request: _Request, token_ids: list[int], index: int,
                      parent: Sequence | None = None, kv: ImportedKv | None = None) -> Sequence:
        seq = Sequence(next(self._seq_ids), token_ids, len(request.prompt_token_ids), request.params,
                       request_id=request.request_id, index=index, grammar=self.grammars.matcher(request.params),
                       lora_id=request.lora_id)
        request.seqs.append(seq)
        request.texts[index] = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids)
        if kv is not None and not (adopt_reserved(self.block_manager, self.runner.kv_cache, seq, kv.reservation)
                                   if kv.reservation is not None
                                   else place_imported(self.block_manager, self.runner.kv_cache, seq, kv)):
            self.kv_imports_evicted += 1  # the prefix it was sent for is gone, or no room: prefilled here
        if parent is None:
            self.scheduler.add(seq)
        else:
            self.scheduler.fork(parent, seq)
        return seq

    def _output(self, request: _Request) -> RequestOutput:
        # Copies, not the sequence's own lists: an output may be read on another thread while
        # the engine keeps appending.
        completions = [
            CompletionOutput(seq.index, request.texts[seq.index].text, seq.output_token_ids, seq.finish_reason,
                             list(seq.logprobs) if seq.params.logprobs is not None else None)
            for seq in request.seqs]
        if request.pending_forks:  # siblings not forked yet: the request is not done
            completions += [CompletionOutput(i, "", []) for i in range(len(completions), request.params.n)]
        first = request.seqs[0]
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions,
                             first.num_cached_tokens,
                             prompt_logprobs_list(first) if first.params.prompt_logprobs is not None else None,
                             first.embedding)

    # ---- validation --------------------------------------------------------------------

    def validate(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Check a request without queueing it; return its prompt token ids.

        Reads only immutable state, so a server can call it from another thread and refuse
        bad input before the request reaches the engine loop.
        """
        if params.pooling is not None and self.config.pipeline_parallel_size > 1:
            raise InvalidRequestError("embeddings are not served with pipeline_parallel_size > 1 yet")
        token_ids = self._tokenize(prompt)
        if params.pooling is not None:  # an embedding: its first k tokens, or refused past the context (embed_input)
            keep = kept_tokens(params.truncate_prompt_tokens, self.max_model_len)
            token_ids = token_ids if keep is None else token_ids[:keep]
            check_length(len(token_ids), self.max_model_len)
        else:
            if params.truncate_prompt_tokens is not None:  # vLLM's: the prompt's last k tokens (-1: the context's)
                keep = self.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
                token_ids = token_ids[-keep:]
            self._validate_length(len(token_ids), params)
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t in params.logit_bias) or any(t >= vocab for t in params.stop_token_ids):
            raise InvalidRequestError(f"logit_bias and stop_token_ids: token ids must be in [0, {vocab})")
        if any(t >= vocab for t in params.allowed_token_ids or []):
            raise InvalidRequestError(f"allowed_token_ids: token ids must be in [0, {vocab})")
        if params.bad_words:
            params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        self.grammars.check(params)  # compiles (and caches) the grammar here, off the engine loop
        return token_ids

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty")
            token_ids = self.tokenizer.encode(prompt)
            if not token_ids:  # e.g. only control characters, which the tokenizer drops: nothing to prefill
                raise InvalidRequestError("the prompt has no tokens: the tokenizer reads nothing in it")
            return token_ids
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise InvalidRequestError("the prompt must be a non-empty string or list of token ids")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        return list(prompt)

    def _validate_length(self, num_prompt: int, params: SamplingParams) -> None:
        limit = self.max_model_len
        if num_prompt >= limit:
            raise InvalidRequestError(
                f"the prompt has {num_prompt} tokens; this model's context holds {limit} "
                f"and at least one must be left to generate", code="context_length_exceeded")
        if params.max_tokens is not None and num_prompt + params.max_tokens > limit:
            raise InvalidRequestError(
                f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) = "
                f"{num_prompt + params.max_tokens} exceeds the context length of {limit} tokens",
                code="context_length_exceeded")


def _build_drafter(config: EngineConfig, runner: ModelRunner, num_blocks: int, show_progress: bool) -> Drafter | None:
    if config.speculative_method == "ngram":
        return NgramDrafter(config.prompt_lookup_max, config.prompt_lookup_min)
    if config.speculative_method == "draft":
        return DraftModelDrafter(config, runner, num_blocks, show_progress)
    return None


def _finished(request: _Request) -> bool:
    """Whether the request's output would be finished (RequestOutput.finished), without building it."""
    return not request.pending_forks and all(seq.finish_reason is not None for seq in request.seqs)


def _started(seq: Sequence) -> bool:
    """Admitted to the batch at least once: running or finished, or back in the queue after a preemption
    (which marks it due at once, as it does a forked sibling of a started request)."""
    return seq.status is not SequenceStatus.WAITING or seq.num_output_tokens > 0 or seq.prefill_due == float("-inf")


def _stop_workers(workers: WorkerPool | PipelineGroup | None) -> None:
    if workers is not None:
        workers.close()


def _start_workers(config: EngineConfig, checkpoint: Checkpoint) -> WorkerPool | PipelineGroup | None:
    """Ranks 1..N-1 start loading their shards while this process loads rank 0's."""
    rdv = world_rendezvous(config)
    if uses_pipeline(config, rdv):
        check_pipeline(config, checkpoint.config)
        return PipelineGroup(config, rdv, checkpoint.config.num_layers)
    if config.tensor_parallel_size == 1:
        return None
    device = pick_device(config.device)
    check_devices(config, checkpoint.config, device)
    return WorkerPool(config, device)
