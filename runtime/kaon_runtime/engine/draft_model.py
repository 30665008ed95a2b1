"""Drafting with a smaller model of the same tokenizer, over its own paged KV cache.

Each target sequence has a shadow sequence on the draft side. Before drafting, the shadow
is lined up with the target: the tokens it drafted and the target kept stay in its cache,
the rest are rolled back. Then k single-token steps of the draft model, batched over all
sequences, produce the drafts; the first step also feeds whatever the draft has not seen
yet (the whole prompt the first time, afterwards the target's own last token or two).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from kaon_runtime.config import EngineConfig
from kaon_runtime.engine.block_manager import BlockManager
from kaon_runtime.engine.drafter import Draft
from kaon_runtime.engine.model_runner import ModelRunner
from kaon_runtime.engine.scheduler import ScheduledBatch
from kaon_runtime.engine.sequence import Sequence
from kaon_runtime.errors import ModelLoadError
from kaon_runtime.layers.sampler import draw, sampling_probs
from kaon_runtime.loader import open_checkpoint

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Shadow:
    seq: Sequence  # the draft side's copy: token ids, block table, computed count
    synced: int  # how many of its tokens are known to equal the target's


class DraftModelDrafter:
    def __init__(self, config: EngineConfig, target: ModelRunner, num_blocks: int, show_progress: bool = True):
        """`num_blocks`: the target's pool as scheduled (the smallest rank's)."""
        assert config.speculative_draft_model is not None, "EngineConfig checks that the method has its model"
        checkpoint = open_checkpoint(config.speculative_draft_model)
        if checkpoint.config.vocab_size != target.model_config.vocab_size:
            raise ModelLoadError(
                f"draft model {config.speculative_draft_model!r} has a vocabulary of {checkpoint.config.vocab_size} "
                f"tokens, the target {target.model_config.vocab_size}: they must share a tokenizer")
        # As many blocks as the target: the draft caches the same tokens, at its own smaller size each.
        # It runs whole, in rank 0's process, whatever the target's tensor parallelism.
        # The draft runs the base model for every sequence, with or without a LoRA adapter.
        draft_config = replace(config, model=config.speculative_draft_model, quantization="none",
                               num_kv_blocks=num_blocks, speculative_method="none",
                               speculative_draft_model=None, tensor_parallel_size=1, lora_modules=None, max_loras=0)
        self.runner = ModelRunner(draft_config, checkpoint, show_progress)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, enable_prefix_caching=False)
        self._target = target
        self._max_len = checkpoint.config.max_position_embeddings
        self._shadows: dict[int, _Shadow] = {}  # by target seq_id

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[Draft]:
        drafted: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor] | None] = [None if s.params.greedy else [] for s in seqs]
        # The draft's context may be shorter than the target's.
        limits = [min(k, self._max_len - seq.num_tokens) for seq, k in zip(seqs, limits)]
        active = [i for i, k in enumerate(limits) if k > 0]
        shadows = {i: self._line_up(seqs[i]) for i in active}
        while active:
            batch = ScheduledBatch()
            for i in list(active):
                shadow = shadows[i]
                num_new = shadow.num_tokens - shadow.num_computed_tokens
                if not self.block_manager.ensure_slots(shadow, shadow.num_tokens):
                    active.remove(i)  # the draft pool is full: this one goes without (more) drafts
                    continue
                batch.seqs.append(shadow)
                batch.num_new_tokens.append(num_new)
            if not batch:
                break
            fed, logits = self.runner.forward(batch)
            assert logits is not None, "every shadow's chunk reaches its end"
            row_of = {id(shadow): row for row, shadow in enumerate(fed)}  # the runner reorders the batch
            for i, shadow, num_new in zip(active, batch.seqs, batch.num_new_tokens):
                shadow.num_computed_tokens += num_new
                token, q = self._draw(seqs[i], logits[row_of[id(shadow)]])
                shadow.token_ids.append(token)
                drafted[i].append(token)
                if q is not None:
                    probs[i].append(q)  # type: ignore[union-attr]  # a list wherever _draw returns a q
            active = [i for i in active if len(drafted[i]) < limits[i]]
        return [Draft(tokens, torch.stack(p) if p else None) for tokens, p in zip(drafted, probs)]

    def forget(self, seq: Sequence) -> None:
        shadow = self._shadows.pop(seq.seq_id, None)
        if shadow is not None:
            self.block_manager.free(shadow.seq)

    def _line_up(self, target: Sequence) -> Sequence:
        """The target's shadow, holding the target's tokens and only K/V that matches them."""
        shadow = self._shadows.get(target.seq_id)
        if shadow is None:
            shadow = self._shadows[target.seq_id] = _Shadow(
                Sequence(target.seq_id, [], target.num_prompt_tokens, target.params), 0)
        seq = shadow.seq
        agreed = shadow.synced
        limit = min(seq.num_computed_tokens, target.num_tokens - 1)  # the target's last token is always fed
        while agreed < limit and seq.token_ids[agreed] == target.token_ids[agreed]:
            agreed += 1
        seq.num_computed_tokens = min(seq.num_computed_tokens, agreed)
        seq.token_ids = list(target.token_ids)
        shadow.synced = target.num_tokens
        self.block_manager.truncate(seq)
        return seq

    def _draw(self, target: Sequence, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """A greedy request drafts the draft's argmax; a sampled one draws from the draft's
        distribution under the request's own settings, which the verifier needs as q."""
        params = target.params
        if params.greedy:
            return int(logits.argmax()), None
        q = sampling_probs(logits[None, :], [params.temperature], [params.top_k], [params.top_p])
        return int(draw(q, [self._target.generator(target)])[0]), q[0]
