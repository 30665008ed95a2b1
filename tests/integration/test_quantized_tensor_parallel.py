"""A GPTQ checkpoint split across two tensor-parallel ranks (CPU worker processes): each rank keeps
its shard of the packed weights, whole groups only, and the pair generates the dequantized weights'
greedy tokens (transformers on them is the reference)."""
from __future__ import annotations

import pytest

from kaon_runtime import LLM, SamplingParams
from kaon_runtime.errors import ModelLoadError
from support.quantized_dirs import greedy, write_packed_dir

pytest.importorskip("transformers")
PROMPTS = [list(range(100, 120)), [5, 9, 300, 4000, 17]]


def test_two_ranks_share_a_gptq_checkpoint(tmp_path, gguf_path, monkeypatch):
    monkeypatch.setenv("KAON_QUANT_KERNEL", "torch")  # float32 reference kernels, inherited by the workers
    reference = write_packed_dir(tmp_path, gguf_path, "gptq", 4, 64, sym=False)
    two = LLM(str(tmp_path), show_progress=False, device="cpu", dtype="float32", tensor_parallel_size=2)
    try:
        outputs = two.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
        assert two.engine.runner.model.model.layers[0].mlp.down_proj.in_features == 256  # half of 512
        assert [o.outputs[0].token_ids for o in outputs] == [greedy(reference, p, 10) for p in PROMPTS]
    finally:
        two.close()


def test_act_order_on_row_parallel_layers_is_refused_under_tensor_parallelism(tmp_path, gguf_path):
    write_packed_dir(tmp_path, gguf_path, "gptq", 4, 64, act_order=True)
    with pytest.raises(ModelLoadError, match=r"_proj: act-order \(g_idx\) weights of a row-parallel layer"):
        LLM(str(tmp_path), show_progress=False, device="cpu", tensor_parallel_size=2)
