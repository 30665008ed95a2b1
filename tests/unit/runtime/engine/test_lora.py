"""LoRA adapters: the slot pool's policy, the adapter checks, the prefix cache's key, and whole models
generating with random PEFT adapters (made by peft itself) against transformers + peft with the
adapter merged, token for token in float32, base and adapters mixed in one batch, on two families
and across eviction and reload (more adapters than slots); int8 base weights against the dequantized model."""
from __future__ import annotations

import json

import pytest

from kaon_runtime.config import ModelConfig
from kaon_runtime.engine.block_manager import BlockManager
from kaon_runtime.engine.lora_pool import SlotTable
from kaon_runtime.engine.scheduler import Scheduler
from kaon_runtime.engine.sequence import Sequence
from kaon_runtime.loader.lora_adapter import AdapterError, check_config, load_adapter
from kaon_runtime.sampling import SamplingParams
from support.lora_adapters import ADAPTERS, build_adapter, build_adapters, build_base, greedy, merged

MODEL = ModelConfig("llama", vocab_size=100, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=16, max_position_embeddings=256)


# ---- the slot pool's policy ----------------------------------------------------------------

def test_slots_load_once_and_evict_the_least_recently_used_adapter_no_running_sequence_needs():
    table = SlotTable(2)
    slots, loads = table.assign({7, 8})
    assert sorted(loads) == [(0, 7), (1, 8)] and slots == {7: 0, 8: 1}
    assert table.assign({7}) == ({7: 0}, [])  # already there: nothing to load
    slots, loads = table.assign({7, 9})  # 8 is least recently used and not wanted
    assert slots == {7: 0, 9: 1} and loads == [(1, 9)]
    slots, loads = table.assign({8, 9})  # 7 goes; 9 stays where it is
    assert slots == {8: 0, 9: 1} and loads == [(0, 8)]
    with pytest.raises(ValueError, match="3 adapters"):
        table.assign({1, 2, 3})


def _seq(seq_id, tokens, lora_id=0):
    return Sequence(seq_id, list(tokens), len(tokens), SamplingParams(max_tokens=4), lora_id=lora_id)


def test_the_scheduler_runs_no_more_distinct_adapters_than_slots():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=256, max_loras=2)
    seqs = [_seq(i, range(10 * i, 10 * i + 5), lora) for i, lora in enumerate([1, 2, 3, 0, 1])]
    for seq in seqs:
        scheduler.add(seq)
    batch = scheduler.schedule()
    assert [s.seq_id for s in batch.seqs] == [0, 1, 3, 4]  # adapter 3 waits for a slot; the base and 1 go ahead
    assert batch.running_adapters == {1, 2}
    assert [s.seq_id for s in scheduler.waiting] == [2]


def test_two_adapters_never_share_prefix_blocks():
    bm = BlockManager(16, 4)
    tokens = list(range(13))
    first = _seq(0, tokens, lora_id=1)
    bm.allocate_prefix(first)
    bm.ensure_slots(first, 13)
    first.num_computed_tokens = 12
    bm.commit(first)
    assert bm.allocate_prefix(_seq(1, tokens, lora_id=1)) == 12  # the same adapter: a hit
    assert bm.allocate_prefix(_seq(2, tokens, lora_id=2)) == 0
    assert bm.allocate_prefix(_seq(3, tokens)) == 0  # nor the base model


# ---- adapters checked at load ------------------------------------------------------------------

@pytest.mark.parametrize("config,reason", [
    ({"r": 8, "target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens"),
    ({"r": 32, "target_modules": ["q_proj"]}, "rank 32 is over"),
    ({"r": 8, "target_modules": ["q_proj"], "use_dora": True}, "DoRA"),
    ({"r": 8, "target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"r": 8, "target_modules": ["q_proj"], "peft_type": "IA3"}, "only LoRA"),
])
def test_adapters_that_do_not_fit_are_refused_with_the_reason(config, reason):
    with pytest.raises(AdapterError, match=reason):
        check_config(config, MODEL, max_rank=16)


def test_adapters_on_experts_are_refused():
    moe = ModelConfig("mixtral", 100, 64, 96, 2, 4, 2, 16, 256, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32)
    assert check_config({"r": 4, "target_modules": ["q_proj"]}, moe, 16) == 1.0
    with pytest.raises(AdapterError, match="experts"):
        check_config({"r": 4, "target_modules": ["q_proj", "down_proj"]}, moe, 16)


def test_scaling_is_alpha_over_rank_or_over_its_root_under_rslora():
    assert check_config({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}, MODEL, 16) == 2.0
    assert check_config({"r": 4, "lora_alpha": 8, "use_rslora": True, "target_modules": ["q_proj"]}, MODEL, 16) == 4.0


# ---- whole models against transformers + peft ----------------------------------------------------------

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
PROMPTS = [list(range(100, 120)), list(range(300, 305)), list(range(1000, 1040)), list(range(7, 30)),
           list(range(200, 211)), list(range(100, 120))]
NAMES = [None, "attn", "mlp", "all", "qv", "attn"]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family(request, tmp_path_factory, gguf_path):
    root = tmp_path_factory.mktemp(request.param)
    base = build_base(request.param, root / "base", gguf_path)
    dirs = build_adapters(base, root, ADAPTERS)
    expected = [greedy(base if n is None else merged(base, dirs[n]), p, 8) for p, n in zip(PROMPTS, NAMES)]
    assert len({tuple(e) for e in expected[:5]}) == 5, "each adapter must change the tokens"
    return root, dirs, expected


@pytest.mark.slow
def test_base_and_adapters_in_one_batch_match_transformers_with_the_adapter_merged(family):
    from kaon_runtime import LLM
    root, dirs, expected = family
    llm = LLM(str(root / "base"), show_progress=False, device="cpu", dtype="float32", adapters=dirs)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False, adapter=NAMES)]
    assert got == expected
    # The last prompt repeats the first under another adapter: no K/V of the base's is reused for it.
    assert llm.engine.runner.lora is not None and llm.engine.runner.lora.num_loads == 4


@pytest.mark.slow
def test_more_adapters_than_slots_evict_and_reload(family):
    from kaon_runtime import LLM
    root, dirs, expected = family
    llm = LLM(str(root / "base"), show_progress=False, device="cpu", dtype="float32", adapters=dirs, max_loras=2)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False, adapter=NAMES)]
    assert got == expected
    again = llm.generate(PROMPTS[1:3], params, use_tqdm=False, adapter=NAMES[1:3])  # evicted, then reloaded
    assert [o.outputs[0].token_ids for o in again] == expected[1:3]
    assert llm.engine.runner.lora.num_loads > 4


@pytest.mark.slow
def test_eight_adapters_over_four_slots_in_one_load_serve_each_request_by_its_own_adapter(tmp_path, gguf_path):
    """The issue's concurrency case: 8 adapters (each changing the tokens its own way) over 4
    slots, three requests each and the base's, all submitted at once in a shuffled order, so
    the scheduler must keep swapping adapters in and out while others run: every request's
    tokens are its own adapter's, none another's."""
    import random

    from kaon_runtime import LLM
    base = build_base("llama", tmp_path / "base", gguf_path)
    dirs = {}
    for seed, (name, config) in enumerate([*ADAPTERS.items(), *ADAPTERS.items()], 1):
        name = f"{name}{seed}"
        dirs[name] = str(tmp_path / name)
        build_adapter(base, name, tmp_path / name, seed, **config)
    prompt = list(range(100, 116))  # one prompt for all: only the adapter tells the outputs apart
    expected = {n: greedy(base if n is None else merged(base, dirs[n]), prompt, 6) for n in [None, *dirs]}
    assert len({tuple(tokens) for tokens in expected.values()}) == len(expected), "each adapter must differ"
    names = [None, *dirs] * 3
    random.Random(0).shuffle(names)
    llm = LLM(str(tmp_path / "base"), show_progress=False, device="cpu", dtype="float32", adapters=dirs,
              max_loras=4, max_num_seqs=6)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([prompt] * len(names), params, use_tqdm=False, adapter=names)]
    assert got == [expected[n] for n in names]
    assert llm.engine.runner.lora.num_loads > len(dirs)  # slots were reused: adapters evicted and reloaded


@pytest.mark.slow
def test_an_adapter_for_another_base_or_unknown_names_are_refused(family, tmp_path):
    from kaon_runtime import LLM
    from kaon_runtime.errors import ModelNotFoundError
    root, dirs, _ = family
    wider = transformers.LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)
    other = transformers.LlamaForCausalLM(wider)
    build_adapter(other, "other", tmp_path / "other", 1, r=4, target_modules=["q_proj"])
    with pytest.raises(AdapterError, match="another base model"):
        load_adapter("other", tmp_path / "other", MODEL, 16)
    llm = LLM(str(root / "base"), show_progress=False, device="cpu", dtype="float32", adapters={"attn": dirs["attn"]})
    with pytest.raises(AdapterError, match="another base model"):
        llm.engine.add_lora("other", str(tmp_path / "other"))
    with pytest.raises(ModelNotFoundError):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), adapter="nope")
    llm.engine.remove_lora("attn")
    assert llm.engine.lora_adapters() == []
    assert json.loads((tmp_path / "other" / "adapter_config.json").read_text())["r"] == 4


# ---- int8 base weights -----------------------------------------------------------------------


def test_lora_on_an_int8_projection_adds_to_the_dequantized_weight():
    import torch
    from torch import nn

    from kaon_runtime.layers.lora import LoraBatch, LoraLinear
    from kaon_runtime.quant.int8 import Int8Linear, quantize_int8
    torch.manual_seed(0)
    dense = nn.Linear(64, 48, bias=False)
    qweight, scales = quantize_int8(dense.weight.detach())
    batch = LoraBatch()
    lora = LoraLinear(Int8Linear(qweight, scales), 64, [48], 1, 8, batch, torch.float32, torch.device("cpu"))
    a, b = torch.randn(4, 64), torch.randn(48, 4)
    lora.load_slot(0, 0, a, b)
    x = torch.randn(3, 64)
    batch.set([0, -1, 0], torch.device("cpu"))
    dequantized = qweight.float() * scales[:, None]
    expected = x @ dequantized.T + torch.tensor([1.0, 0.0, 1.0])[:, None] * (x @ a.T @ b.T)
    # The CPU int8 kernel rounds its activations: close to the dequantized reference, not equal.
    torch.testing.assert_close(lora(x), expected, rtol=2e-2, atol=2e-2)


def _saved_base(root):
    return transformers.AutoModelForCausalLM.from_pretrained(root / "base", dtype="float32").eval()


def _dequantized_int8(model):
    """A copy of an HF model whose linear weights (head included) went through kaon's int8 and back."""
    import copy

    import torch

    from kaon_runtime.quant.int8 import quantize_int8
    model = copy.deepcopy(model)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                qweight, scales = quantize_int8(module.weight)
                module.weight.copy_(qweight.float() * scales[:, None])
    return model


@pytest.mark.slow
def test_int8_base_with_adapters_matches_the_dequantized_reference(family, float_kernels):
    """int8 base weights through the dequantizing torch kernel (the C kernels, which round their activations,
    off), base and adapters mixed in one batch: the tokens of transformers + peft merged into the dequantized model."""
    from kaon_runtime import LLM
    # float_kernels: the torch kernel, the C library off, its cached None cleared at teardown even when this
    # fails (cleared only on success, a failure here left the worker's later tests without the C kernels).
    root, dirs, _ = family
    base = _dequantized_int8(_saved_base(root))
    expected = [greedy(base if n is None else merged(base, dirs[n]), p, 8) for p, n in zip(PROMPTS, NAMES)]
    llm = LLM(str(root / "base"), show_progress=False, device="cpu", dtype="float32", adapters=dirs,
              quantization="int8", kv_cache_dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False, adapter=NAMES)]
    assert got == expected


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_with_adapters_keeps_each_adapters_greedy_tokens(family, method):
    """The drafter (prompt lookup, or a draft model: here the base itself) runs without adapters; the
    target verifies with each sequence's adapter, so the tokens stay those of the merged model."""
    from kaon_runtime import LLM
    root, dirs, expected = family
    draft = dict(speculative_draft_model=str(root / "base")) if method == "draft" else {}
    llm = LLM(str(root / "base"), show_progress=False, device="cpu", dtype="float32", adapters=dirs,
              speculative_method=method, num_speculative_tokens=3, **draft)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False, adapter=NAMES)]
    assert got == expected
    if method == "draft":  # prompt lookup finds nothing to propose in these prompts
        assert llm.engine.stats().spec_draft_tokens > 0


# ---- float16 / bfloat16 models: the C step adds the adapters (issue 49 §2) ------------------------

HALF_PROMPTS = [list(range(100, 120)), list(range(300, 305)), list(range(1000, 1040)), list(range(7, 30))]
HALF_NAMES = ["attn", None, "all", "attn"]  # two adapters and the base in one batch, one adapter twice


@pytest.fixture(scope="module")
def half_family(tmp_path_factory, gguf_path):
    root = tmp_path_factory.mktemp("half")
    base = build_base("llama", root / "base", gguf_path)
    return root, build_adapters(base, root, {name: ADAPTERS[name] for name in ("attn", "all")})


def _answers(llm, prompts, names):
    """Each request's tokens and each token's own log-probability, greedy."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False, adapter=names)
    return [(o.outputs[0].token_ids, [step[t] for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outputs]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_models_adapter_answers_alike_alone_batched_chunked_and_cached(half_family, dtype, monkeypatch):
    """A float16 / bfloat16 model with adapters: each request (two adapters and the base) gets the same tokens
    and log-probabilities, bit for bit, alone, in one batch with the others, in prefill chunks of 16 tokens, and
    again with its prefix cached. The fused C step reads the half slots (models/fused_weights.lora_slots),
    each row alone; torch's half path, which such steps took before, groups the rows by adapter."""
    from kaon_runtime import LLM
    for name in ("KAON_CPU_PREFILL", "KAON_CPU_DECODE", "KAON_CPU_ACTIVATIONS"):
        monkeypatch.delenv(name, raising=False)
    root, dirs = half_family
    options = dict(show_progress=False, device="cpu", dtype=dtype, adapters=dirs)
    with LLM(str(root / "base"), enable_prefix_caching=False, **options) as plain, \
            LLM(str(root / "base"), enable_prefix_caching=True, max_num_batched_tokens=16, **options) as chunked:
        step = plain.engine.runner.model.model.cpu_decode
        assert step is not None and step.reads_lora(), "the C step takes the steps with adapters"
        alone = [_answers(plain, [p], [n])[0] for p, n in zip(HALF_PROMPTS, HALF_NAMES)]
        base_of_first = _answers(plain, HALF_PROMPTS[:1], [None])[0]
        assert alone[0] != base_of_first, "the adapter must change the answer"
        assert _answers(plain, HALF_PROMPTS, HALF_NAMES) == alone, "in one batch"
        assert _answers(chunked, HALF_PROMPTS, HALF_NAMES) == alone, "in chunks of 16, batched"
        hits = chunked.engine.stats().prefix_cache_hits
        cached = [_answers(chunked, [p], [n])[0] for p, n in zip(HALF_PROMPTS, HALF_NAMES)]
        assert chunked.engine.stats().prefix_cache_hits > hits, "the prompts' blocks were cached"
        assert cached == alone, "with its prefix cached"


@pytest.mark.slow
def test_vllms_lora_request_runs_each_prompt_with_its_adapter(family):
    """vLLM's `LLM(enable_lora=True).generate(..., lora_request=LoRARequest(name, int_id, path))`: the adapter
    registered on first use by name, per-prompt requests in order, the same tokens as peft's merged model."""
    from kaon_runtime import LLM
    from kaon_runtime.errors import InvalidRequestError
    from kaon_runtime.lora import LoRARequest as Exported
    from kaon_runtime.lora.request import LoRARequest
    assert Exported is LoRARequest
    root, dirs, expected = family
    llm = LLM(str(root / "base"), show_progress=False, device="cpu", dtype="float32", enable_lora=True, max_loras=2)
    ids = {name: i for i, name in enumerate(dirs, 1)}
    requests = [None if n is None else LoRARequest(n, ids[n], dirs[n]) for n in NAMES]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False, lora_request=requests)]
    assert got == expected
    one = llm.generate(PROMPTS[2], params, use_tqdm=False, lora_request=LoRARequest("mlp", ids["mlp"], dirs["mlp"]))
    assert one[0].outputs[0].token_ids == expected[2]
    with pytest.raises(InvalidRequestError, match="lora_int_id 1 is already"):
        llm.generate(PROMPTS[0], params, use_tqdm=False, lora_request=LoRARequest("other", 1, dirs["mlp"]))
    with pytest.raises(TypeError, match="adapter or lora_request"):
        llm.generate(PROMPTS[0], params, use_tqdm=False, adapter="mlp", lora_request=requests[1])
    with pytest.raises(ValueError, match="id must be > 0"):
        LoRARequest("x", 0, dirs["mlp"])
    assert LoRARequest("a", 1, "p") == LoRARequest("a", 2, "q") and LoRARequest("a", 1, "p").path == "p"
    llm.close()
