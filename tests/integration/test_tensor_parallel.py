"""Tensor parallelism on CPU with gloo: N processes, each holding a shard, generate what one does.

The bundled SmolLM2 has 9 attention heads and 3 KV heads, which 2 does not divide, so the
TP=2 comparisons run on tiny random HF Llama/Qwen2 directories (4 heads, 2 or 1 KV heads:
the latter replicated on both ranks) and the bundled model is checked at TP=3.
"""
from __future__ import annotations

import pytest
import torch

from kaon_runtime import LLM, SamplingParams
from kaon_runtime.config import EngineConfig, ModelConfig
from kaon_runtime.distributed.sharding import (
    check_tensor_parallel,
    cut,
    kv_head_start,
    local_config,
    vocab_range,
)
from kaon_runtime.engine.workers import check_devices
from kaon_runtime.errors import ModelLoadError
from support.hf_dirs import write_hf_dir

transformers = pytest.importorskip("transformers")

MODEL = "builtin://smollm2-135m-instruct"


def shape(heads=4, kv_heads=2, intermediate=160, vocab=50) -> ModelConfig:
    return ModelConfig("llama", vocab, 64, intermediate, 2, heads, kv_heads, 16, 128)


# ---- pure parts --------------------------------------------------------------------------

def test_sizes_that_do_not_divide_the_model_are_refused():
    with pytest.raises(ModelLoadError, match="9 attention heads"):
        check_tensor_parallel(shape(heads=9, kv_heads=3), 2)
    with pytest.raises(ModelLoadError, match="3 KV heads"):
        check_tensor_parallel(shape(heads=12, kv_heads=3), 2)
    with pytest.raises(ModelLoadError, match="MLP width 150"):
        check_tensor_parallel(shape(intermediate=150), 4)
    check_tensor_parallel(shape(heads=8, kv_heads=2), 4)
    check_tensor_parallel(shape(heads=8, kv_heads=2), 8)  # KV heads replicated 4 times


def test_more_gpus_than_exist_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ModelLoadError, match="needs 2 GPUs; 1 visible"):
        check_devices(EngineConfig(tensor_parallel_size=2), shape(), torch.device("cuda"))
    check_devices(EngineConfig(tensor_parallel_size=2), shape(), torch.device("cpu"))  # CPU: any N, for tests


def test_shards_put_back_together_are_the_checkpoint():
    c = shape(heads=4, kv_heads=2, vocab=50)
    torch.manual_seed(0)
    tensors = {"model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64),
               "model.layers.0.self_attn.k_proj.weight": torch.randn(32, 64),
               "model.layers.0.self_attn.o_proj.weight": torch.randn(64, 64),
               "model.layers.0.mlp.gate_proj.weight": torch.randn(160, 64),
               "model.layers.0.mlp.down_proj.weight": torch.randn(64, 160),
               "model.layers.0.input_layernorm.weight": torch.randn(64)}
    for name, full in tensors.items():
        parts = [cut(name, full, c, rank, 2) for rank in range(2)]
        dim = 1 if ("o_proj" in name or "down_proj" in name) else 0
        if full.dim() == 1:
            assert all(torch.equal(p, full) for p in parts)  # norms are replicated
        else:
            assert torch.equal(torch.cat(parts, dim=dim), full), name
    embed = torch.randn(50, 64)
    shards = [cut("model.embed_tokens.weight", embed, c, rank, 3) for rank in range(3)]
    assert [s.shape[0] for s in shards] == [17, 17, 17] and vocab_range(50, 2, 3) == (34, 17)
    assert torch.equal(torch.cat(shards)[:50], embed) and not shards[2][16:].any()  # padding is zeros


def test_fewer_kv_heads_than_ranks_are_replicated():
    c = shape(heads=8, kv_heads=2)
    assert local_config(c, 4).num_kv_heads == 1
    assert [kv_head_start(2, rank, 4) for rank in range(4)] == [0, 0, 1, 1]
    k = torch.arange(32.0)[:, None].repeat(1, 64)  # 2 heads of 16 rows
    parts = [cut("model.layers.0.self_attn.k_proj.weight", k, c, rank, 4) for rank in range(4)]
    assert torch.equal(parts[0], parts[1]) and torch.equal(parts[0], k[:16]) and torch.equal(parts[3], k[16:])


# ---- whole engines -------------------------------------------------------------------------

SMALL = dict(vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
             max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
FAMILIES = {  # name: (config class, model class, extra config, engine options)
    "llama-untied": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                     dict(num_key_value_heads=2, tie_word_embeddings=False), {}),
    # One KV head for two ranks (replicated), tied embeddings, q/k/v biases, and speculative decoding
    # on top: the model drafts for itself (whole, on rank 0), so nearly every draft is kept.
    "qwen2-tied-spec": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                        dict(num_key_value_heads=1, tie_word_embeddings=True),
                        dict(speculative_method="draft", num_speculative_tokens=3)),
    # Experts cut like MLPs (each rank a half of every expert), routers and q/k norms replicated.
    "qwen3-moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       head_dim=16), {}),
    # Soft-capping and windows act per head; a checkpoint with fused qkv_proj/gate_up_proj is split before cutting.
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               dict(num_key_value_heads=2, head_dim=16, sliding_window=24, attn_logit_softcapping=2.0), {}),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(num_key_value_heads=2, pad_token_id=0), {}),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, gguf_path):
    config_cls, model_cls, extra, options = FAMILIES[request.param]
    torch.manual_seed(0)
    model = model_cls(config_cls(**SMALL, **extra))
    path = tmp_path_factory.mktemp(request.param)
    write_hf_dir(model, path, gguf_path, {"eos_token": "<|im_end|>"})
    if options:
        options = dict(options, speculative_draft_model=str(path))
    return str(path), options


def test_two_ranks_generate_what_one_does_with_half_the_weights_each(family):
    path, options = family
    prompts = [[5, 6, 7, 8, 9], list(range(100, 160)), [300, 301, 302, 300, 301, 302, 300, 301]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one = LLM(path, show_progress=False, device="cpu", dtype="float64")
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    two = LLM(path, show_progress=False, device="cpu", dtype="float64", tensor_parallel_size=2, **options)
    try:
        got = [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)]
        assert got == expected
        whole = one.engine.runner.weight_bytes
        for rank_bytes in [two.engine.runner.weight_bytes] + two.engine.worker_weight_bytes:
            assert 0.49 * whole < rank_bytes < 0.52 * whole
        if options:
            stats = two.engine.stats()
            assert stats.spec_accepted_tokens >= 0.9 * stats.spec_draft_tokens > 0
    finally:
        two.close()


@pytest.mark.slow
def test_bundled_model_at_three_ranks_matches_one(llm):
    """SmolLM2's 9 heads and 3 KV heads split three ways; float32, greedy, the correctness prompts."""
    from support.prompts import QUESTIONS, chat_ids
    prompts = [chat_ids(llm, q) for q in QUESTIONS[:3]]
    params = SamplingParams(temperature=0, max_tokens=16)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    three = LLM(MODEL, show_progress=False, device="cpu", dtype="float32", tensor_parallel_size=3)
    try:
        assert [o.outputs[0].token_ids for o in three.generate(prompts, params, use_tqdm=False)] == expected
        whole = llm.engine.runner.weight_bytes
        for rank_bytes in [three.engine.runner.weight_bytes] + three.engine.worker_weight_bytes:
            assert 0.33 * whole < rank_bytes < 0.34 * whole
    finally:
        three.close()


def test_the_bundled_model_refuses_two_ranks_at_start():
    with pytest.raises(ModelLoadError, match="tensor_parallel_size 2 does not divide its 9 attention heads"):
        LLM(MODEL, show_progress=False, device="cpu", tensor_parallel_size=2)


def test_kaon_serve_passes_the_tensor_parallel_size():
    from kaon_runtime.cli import build_parser, engine_config
    assert engine_config(build_parser().parse_args(["serve", "--tensor-parallel-size", "4"])).tensor_parallel_size == 4


def test_a_script_without_a_main_guard_is_told_to_add_one(tmp_path):
    """spawn runs the script again in each worker; without `if __name__ == "__main__":` the workers
    would try to start workers of their own and die in multiprocessing's bootstrap traceback."""
    import subprocess
    import sys
    script = tmp_path / "no_guard.py"
    script.write_text("from kaon_runtime import LLM\n"
                      f"LLM({MODEL!r}, show_progress=False, device='cpu', tensor_parallel_size=3)\n"
                      "print('loaded')\n")
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "loaded" not in res.stdout
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("kaon_runtime.errors.ModelLoadError: tensor_parallel_size 3 starts 2 worker process(es)"), \
        res.stderr[-2000:]
    assert 'under `if __name__ == "__main__":`' in last
    assert "bootstrapping phase" not in res.stderr and "while loading" not in res.stderr
