"""Issue 53: what a sleeping engine frees and how waking puts it back (engine/sleep.py)."""
from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

from kaon_runtime import SamplingParams
from kaon_runtime.engine import sleep


class _Packed(nn.Module):
    """A module that keeps a tensor as a plain attribute (as packed and quantized linears do)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3))
        self.register_buffer("scale", torch.arange(4.0))
        self.packed = torch.randn(2, 5)
        self.head = self.weight  # the same tensor held twice: written once


def test_level_two_writes_every_tensor_out_and_maps_it_back_unchanged(tmp_path):
    model = nn.Sequential(_Packed(), _Packed())
    before = [t.clone() for t in sleep._tensors(model)]
    assert len(before) == 6  # weight, scale, packed per module; the alias once
    spill = sleep._spill(model, str(tmp_path))
    assert spill is not None and all(t.numel() == 0 for t in sleep._tensors(model) + spill.tensors)
    assert model[0].head is model[0].weight  # whoever holds a tensor sees it emptied, and refilled below
    assert list(tmp_path.iterdir()) == []  # its name is gone while asleep: a process that dies asleep leaves no file
    sleep._unspill(model, spill)
    assert [torch.equal(a, b) for a, b in zip(before, sleep._tensors(model), strict=True)] == [True] * 6
    assert list(tmp_path.iterdir()) == []  # the file's name is gone; its pages stay mapped


def test_an_opaque_layout_falls_back_to_loading_the_checkpoint(tmp_path):
    model = _Packed()
    model.packed = torch.randn(4, 4).to_sparse()
    assert sleep._spill(model, str(tmp_path)) is None and model.weight.numel() == 12  # nothing freed, no file
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_level_one_frees_the_pool_and_wakes_with_one_of_the_same_size(llm, caplog):
    """(That the answers stay the same: tests/integration/test_sleep_serve.py, on a real server.)"""
    engine = llm.engine
    llm.generate(["A prefix left in the cache, long enough to fill a block or two of it. " * 3],
                 SamplingParams(max_tokens=1))

    def cached() -> int:
        return sum(block.hash is not None for block in engine.block_manager.blocks)

    assert cached() > 0
    blocks, weights = engine.runner.num_blocks, engine.runner.model.model.norm.weight
    pool = weakref.ref(engine.runner.kv_cache)
    slept = sleep.put_to_sleep(engine, 1)
    try:
        assert pool() is None and "still holds the KV pool" not in caplog.text  # freed: nothing else holds it
        assert engine.runner.kv_cache is None and all(a.k_cache is None
                                                      for a in engine.runner.model.attention_layers())
        assert cached() == 0  # the cached prefixes went with the pool
        assert weights.numel() > 0  # on CPU, level 1 leaves the weights where they are
    finally:  # woken whatever failed: the session's engine serves this worker's later test files
        sleep.wake_up(engine, slept)
    assert engine.runner.kv_cache is not None and engine.runner.kv_cache.shape[3] == blocks
    assert engine.kv_exports.cache() is engine.runner.kv_cache  # disaggregation reads the new pool
    assert all(a.k_cache is not None for a in engine.runner.model.attention_layers())


def test_what_cannot_sleep_says_why(llm):
    assert sleep.unsupported(llm.engine, 1) is None and sleep.unsupported(llm.engine, 2) is None
    assert "level must be 1 or 2" in sleep.unsupported(llm.engine, 0)


@pytest.mark.slow
def test_level_two_leaves_nothing_holding_the_weights(llm, tmp_path):
    """Level 2 frees the weights: no tensor may still hold their storage. The vocabulary head's C struct
    (VocabHead._cpu_weights, built on first use) held the head's [hidden, vocab] table, 108 MiB of the bundled
    model's 540 MiB in float32, through every sleep: RSS fell by 83% of the weights, and after a wake the old
    table sat beside the mapped-back one. Answers after the wake are the aggregated ones, token for token."""
    import gc

    engine = llm.engine
    prompt, params = ["The capital of France is"], SamplingParams(max_tokens=8, temperature=0)
    before = llm.generate(prompt, params)[0].outputs[0].token_ids  # the head's struct is built by now
    weights = {t.untyped_storage().data_ptr() for t in sleep._tensors(engine.runner.model) if t.numel() > 1 << 20}
    slept = sleep.put_to_sleep(engine, 2, spill_dir=str(tmp_path))
    try:
        gc.collect()
        held = [tuple(o.shape) for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.numel()
                and o.untyped_storage().data_ptr() in weights]
        assert held == [], f"tensors still holding the weights' storage after a level-2 sleep: {held}"
    finally:  # woken whatever failed: the session's engine serves this worker's later test files
        sleep.wake_up(engine, slept)
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == before


@pytest.mark.slow
def test_vllms_offline_sleep_and_wake_up_answer_as_before(gguf_path, llm):
    """vLLM's LLM(..., enable_sleep_mode=True).sleep(level) / wake_up(tags) / is_sleeping, on the bundled
    model: greedy tokens equal before and after each level; generating asleep is a clear error (vLLM's
    offline LLM has no defined answer there: kaon refuses, as its server does, rather than wake silently)."""
    from kaon_runtime import LLM
    from kaon_runtime.errors import InvalidRequestError
    with pytest.raises(InvalidRequestError, match="enable_sleep_mode=True"):
        llm.sleep()  # the session's LLM, made without sleep mode
    llm = LLM(str(gguf_path), show_progress=False, device="cpu", dtype="float32", kv_cache_bytes=16 << 20,
              enable_sleep_mode=True)
    try:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        prompt = "The capital of France is"
        before = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        for level, tags in ((1, None), (2, ["weights"]), (1, ["weights", "kv_cache"])):
            assert not llm.is_sleeping()
            llm.sleep(level=level)
            assert llm.is_sleeping() and llm.engine.runner.kv_cache is None
            with pytest.raises(sleep.EngineAsleepError, match="wake_up"):
                llm.generate(prompt, params, use_tqdm=False)
            with pytest.raises(InvalidRequestError, match="already asleep"):
                llm.sleep()
            llm.wake_up(tags=tags)
            llm.wake_up(tags=["kv_cache"])  # vLLM's second half of a wake in parts: awake already, nothing to do
            assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == before
        with pytest.raises(InvalidRequestError, match="unknown tags"):
            llm.wake_up(tags=["everything"])
    finally:
        llm.close()
