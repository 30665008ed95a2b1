"""A dropped engine gives its memory back at once, not when Python's cycle collector happens to run.

On a GPU that is the difference between a process that can build a second engine and one that runs out
of device memory (the 2026-11-30 lease's engine tests did: each engine's KV pool takes 85% of what is
free). The collector runs on counts of Python objects, not on bytes, so an engine kept alive by a
reference cycle holds its pool for as long as Python allocates little. The cycles found: callbacks that
read the pool through the engine, the decode graphs' forward bound to the runner, the CPU step holding
the decoder that holds it.
"""
from __future__ import annotations

import gc
import weakref

import pytest

from kaon_runtime import LLM, SamplingParams


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "static-decode-buffers"])
def test_a_dropped_llm_frees_its_kv_pool_without_the_cycle_collector(tiny_llama, graphs):
    llm = LLM(tiny_llama, show_progress=False, device="cpu", dtype="float32", block_size=8,
              max_num_batched_tokens=32)
    if graphs:  # the decode-graph path's buffers and forward, without capture (CPU)
        llm.engine.runner.config.cuda_graph_max_batch = 4
        llm.engine.runner.prepare_decode_graphs(llm.engine.max_model_len, capture=False)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    pool, engine = weakref.ref(llm.engine.runner.kv_cache), weakref.ref(llm.engine)
    gc.disable()
    try:
        del llm
        assert engine() is None and pool() is None
    finally:
        gc.enable()
