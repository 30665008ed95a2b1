"""Speculative decoding: prompt-lookup and draft-model drafting, exact verification, rollback.

Greedy output must not change at all with speculation; sampled output must keep the
target's distribution, which is checked with chi-square tests, first on the rejection
sampler alone with synthetic distributions, then end to end on a tiny random Llama with a
vocabulary of eight tokens. All draws are seeded, so the tests are deterministic.
"""
from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import torch

from kaon_runtime import LLM, SamplingParams
from kaon_runtime.engine.block_manager import BlockManager
from kaon_runtime.engine.drafter import draft_limit, prompt_lookup
from kaon_runtime.engine.llm_engine import EngineStats
from kaon_runtime.engine.scheduler import Scheduler
from kaon_runtime.engine.sequence import Sequence
from kaon_runtime.errors import InvalidRequestError
from kaon_runtime.layers.rejection import residual, verify
from kaon_runtime.server.metrics import Metrics

# Whole models generating: `make test` runs these, `make unit` (the inner loop) leaves them out.
pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

MODEL = "builtin://smollm2-135m-instruct"
CODE = '''def area(width, height):
    return width * height


def perimeter(width, height):
    return 2 * (width + height)


for w, h in [(1, 2), (3, 4), (5, 6)]:
    print(area(w, h), perimeter(w, h))
'''
# Prompts the 135M model answers partly by copying from them, so prompt lookup gets accepted.
REPETITIVE = [
    "Fix the bug in this code: area should use width * height * 1. Reply with the complete file only.\n"
    "```python\n" + CODE + "```",
    "Count from one to twenty in words, separated by commas.",
    "Repeat this list exactly: apple, banana, cherry, apple, banana, cherry, apple, banana, cherry.",
    "What is the capital of France?",
]


def chi_square_p(observed: list[float], expected: list[float]) -> float:
    """Upper tail of the chi-square statistic, cells with expected count < 5 pooled into one."""
    small = [i for i, e in enumerate(expected) if e < 5]
    cells = [(o, e) for i, (o, e) in enumerate(zip(observed, expected)) if i not in small]
    if small:
        cells.append((sum(observed[i] for i in small), sum(expected[i] for i in small)))
    stat = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def two_sample_p(a: Counter, b: Counter) -> float:
    """Chi-square test that two samples of equal size come from one distribution."""
    keys = sorted(set(a) | set(b))
    n_a, n_b = sum(a.values()), sum(b.values())
    assert n_a == n_b
    pooled = [(a[k] + b[k]) / 2 for k in keys]
    return chi_square_p([a[k] for k in keys] + [b[k] for k in keys], pooled + pooled)


# ---- pure parts ------------------------------------------------------------------------

def test_prompt_lookup_proposes_what_followed_the_latest_match():
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 2, 3, 4]
    assert prompt_lookup(tokens, k=3, max_ngram=3) == [6, 7, 2]  # the latest "2 3 4" wins
    assert prompt_lookup(tokens, k=10, max_ngram=3) == [6, 7, 2, 3, 4]  # runs up to the end
    assert prompt_lookup([1, 2, 3, 8, 2, 3], k=2, max_ngram=3) == [8, 2]  # falls back to shorter n-grams
    assert prompt_lookup([1, 2, 3], k=2, max_ngram=3) == []
    assert prompt_lookup([5, 1, 7, 1], k=2, max_ngram=3, min_ngram=2) == []  # unigram matches not wanted
    assert prompt_lookup([5, 1, 7, 1], k=2, max_ngram=3, min_ngram=1) == [7, 1]


def test_draft_limit_leaves_room_for_the_extra_token():
    seq = Sequence(0, [1] * 10, 8, SamplingParams(max_tokens=5))  # 2 of 5 output tokens made
    assert draft_limit(seq, k=8, max_model_len=100) == 2  # 2 drafts + 1 token = the 3 left
    assert draft_limit(seq, k=8, max_model_len=12) == 1  # the context holds 2 more
    assert draft_limit(seq, k=8, max_model_len=11) == 0


def test_config_refuses_inconsistent_speculation():
    from kaon_runtime.config import EngineConfig
    with pytest.raises(InvalidRequestError, match="speculative_method"):
        EngineConfig(speculative_method="medusa")
    with pytest.raises(InvalidRequestError, match="speculative_draft_model"):
        EngineConfig(speculative_method="draft")
    with pytest.raises(InvalidRequestError, match="num_speculative_tokens"):
        EngineConfig(speculative_method="ngram", num_speculative_tokens=0)


def test_scheduler_trims_drafts_to_the_budget_and_the_pool():
    bm = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=3)
    seq = Sequence(0, [1, 2, 3, 4, 5], 5, SamplingParams())
    sched.add(seq)
    first = sched.schedule()
    assert first.num_new_tokens == [3]
    seq.num_computed_tokens += 3
    sched.schedule()
    seq.num_computed_tokens = 4  # the prompt is in; its last token is next
    seq.draft_token_ids = [6, 7, 8, 9]
    assert sched.schedule().num_new_tokens == [3] and seq.draft_token_ids == [6, 7]  # budget 3: 1 + 2 drafts
    sched.max_num_batched_tokens = 100
    seq.draft_token_ids = [6, 7, 8, 9, 10]
    # 5 + 5 tokens need 3 blocks, the pool has 2: the drafts go, nobody is preempted.
    assert sched.schedule().num_new_tokens == [1] and seq.draft_token_ids == []
    assert sched.num_preemptions == 0


def test_greedy_verification_keeps_drafts_while_they_equal_the_argmax():
    logits = torch.full((4, 10), -5.0)
    for row, best in enumerate([3, 1, 4, 1]):
        logits[row, best] = 5.0
    greedy = SamplingParams(temperature=0)
    assert verify(logits, [3, 1, 4], None, greedy, None) == [3, 1, 4, 1]
    assert verify(logits, [3, 2, 4], None, greedy, None) == [3, 1]
    assert verify(logits, [0, 1, 4], None, greedy, None) == [3]


def test_residual_is_the_positive_part_of_p_minus_q():
    p = torch.tensor([0.5, 0.3, 0.2])
    assert torch.allclose(residual(p, 1, None), torch.tensor([0.5, 0.0, 0.2]) / 0.7)
    q = torch.tensor([0.2, 0.6, 0.2])
    assert torch.allclose(residual(p, 1, q), torch.tensor([1.0, 0.0, 0.0]))


@pytest.mark.parametrize("drafter", ["deterministic", "sampled"])
def test_rejection_sampling_keeps_the_target_distribution(drafter):
    """Each emitted position follows the target's p, whatever the draft guessed."""
    vocab, k, trials = 6, 2, 6000
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(k + 1, vocab, generator=gen) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, vocab, generator=gen) * 1.5, dim=-1)
    params = SamplingParams(temperature=1.0)
    first, second, kept = Counter(), Counter(), 0
    for _ in range(trials):
        if drafter == "deterministic":
            draft, draft_probs = p[:k].argmax(dim=-1).tolist(), None  # one fixed guess: q is one-hot
        else:
            draft, draft_probs = torch.multinomial(q, 1, generator=gen)[:, 0].tolist(), q
        out = verify(p.log(), draft, draft_probs, params, gen)
        kept += len(out) - 1
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    n_second = sum(second.values())
    assert kept > trials // 4 and n_second > 1000
    assert chi_square_p([first[t] for t in range(vocab)], (p[0] * trials).tolist()) > 1e-3
    assert chi_square_p([second[t] for t in range(vocab)], (p[1] * n_second).tolist()) > 1e-3


def test_chi_square_helper_rejects_a_wrong_distribution():
    """The statistical tests above have teeth: a visibly biased sample fails them."""
    p = [0.5, 0.3, 0.2]
    assert chi_square_p([3200, 1800, 1000], [3000, 1800, 1200]) < 1e-3
    assert chi_square_p([3010, 1790, 1200], [x * 6000 for x in p]) > 1e-3


# ---- the real model ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def prompts(llm):
    return [llm.encode_chat([{"role": "user", "content": q}]) for q in REPETITIVE]


@pytest.fixture(scope="module")
def plain_outputs(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=48)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_prompt_lookup_greedy_equals_plain_greedy(prompts, plain_outputs):
    spec = LLM(MODEL, show_progress=False, device="cpu", dtype="float32", speculative_method="ngram",
               num_speculative_tokens=4)
    params = SamplingParams(temperature=0, max_tokens=48)
    alone = [spec.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts[:2]]
    together = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert alone == plain_outputs[:2]
    assert together == plain_outputs
    stats = spec.engine.stats()
    assert 0 < stats.spec_accepted_tokens <= stats.spec_draft_tokens
    assert spec.engine.block_manager.num_free_blocks == spec.engine.block_manager.num_blocks


def test_draft_model_greedy_equals_plain_greedy(prompts, plain_outputs):
    """The model as its own draft: every draft is the target's own choice, so nearly all are kept."""
    spec = LLM(MODEL, show_progress=False, device="cpu", dtype="float32", speculative_method="draft",
               speculative_draft_model=MODEL, num_speculative_tokens=3)
    together = [o.outputs[0].token_ids
                for o in spec.generate(prompts, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)]
    assert together == plain_outputs
    stats = spec.engine.stats()
    assert stats.spec_accepted_tokens >= 0.9 * stats.spec_draft_tokens > 0
    drafter = spec.engine.drafter
    assert drafter.block_manager.num_free_blocks == drafter.block_manager.num_blocks
    assert not drafter._shadows


# ---- a tiny model with a tiny vocabulary ---------------------------------------------------

VOCAB = 8


def tiny_llama_dir(path, seed: int):
    """A random Llama with 8 tokens; a word-level tokenizer names them t0..t7."""
    from tokenizers import Tokenizer, models
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      bos_token_id=0, eos_token_id=7)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # logits a few nats apart: neither uniform nor deterministic
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0")).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t7"}))
    return str(path)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    return (tiny_llama_dir(tmp_path_factory.mktemp("target"), seed=0),
            tiny_llama_dir(tmp_path_factory.mktemp("draft"), seed=1))


def tiny_llm(path: str, **options) -> LLM:
    return LLM(path, show_progress=False, device="cpu", dtype="float64", max_num_seqs=256,
               max_num_batched_tokens=4096, **options)


TINY_PROMPT = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]
TINY_OPTIONS = {
    "ngram": dict(speculative_method="ngram", prompt_lookup_min=1, num_speculative_tokens=3),
    "draft": dict(speculative_method="draft", num_speculative_tokens=3),
}


def sample_continuations(llm: LLM, count: int, seed_base: int) -> list[tuple[int, ...]]:
    params = [SamplingParams(temperature=1.0, seed=seed_base + i, max_tokens=4, ignore_eos=True) for i in range(count)]
    return [tuple(o.outputs[0].token_ids) for o in llm.generate([TINY_PROMPT] * count, params, use_tqdm=False)]


def speculation_p_value(tiny_dirs, method: str, count: int = 3000) -> tuple[float, EngineStats]:
    """The smallest p-value of two-sample tests, spec vs plain, on the first, second and fourth
    tokens and on the first pair; and the speculative engine's counters."""
    target, draft = tiny_dirs
    options = dict(TINY_OPTIONS[method])
    if method == "draft":
        options["speculative_draft_model"] = draft
    plain = sample_continuations(tiny_llm(target), count, seed_base=0)
    spec_llm = tiny_llm(target, **options)
    spec = sample_continuations(spec_llm, count, seed_base=10 ** 6)
    parts = (lambda t: t[0], lambda t: t[1], lambda t: t[:2], lambda t: t[3])
    return (min(two_sample_p(Counter(map(part, plain)), Counter(map(part, spec))) for part in parts),
            spec_llm.engine.stats())


@pytest.mark.parametrize("method", sorted(TINY_OPTIONS))
def test_sampling_with_speculation_keeps_the_distribution(tiny_dirs, method):
    p_value, stats = speculation_p_value(tiny_dirs, method)
    assert stats.spec_draft_tokens > 3000 and 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert p_value > 1e-3


def test_the_distribution_test_catches_a_wrong_verifier(tiny_dirs, monkeypatch):
    """The end-to-end test has teeth: resampling from p instead of the residual after a
    rejection (a classic mistake) skews the output enough to fail it."""
    monkeypatch.setattr("kaon_runtime.layers.rejection.residual", lambda p, token, q: p)
    p_value, _ = speculation_p_value(tiny_dirs, "draft")
    assert p_value < 1e-3


@pytest.mark.parametrize("method", sorted(TINY_OPTIONS))
def test_rollback_leaks_nothing_and_caches_only_kept_tokens(tiny_dirs, method):
    """Many steps of speculation with aborts, preemption and prefix caching: greedy output as
    without speculation, every block back at the end, and every cached block holding exactly
    the tokens of a sequence that owns it."""
    target, draft = tiny_dirs
    options = dict(TINY_OPTIONS[method], num_kv_blocks=40, block_size=4)
    if method == "draft":
        options["speculative_draft_model"] = draft
    rng = random.Random(0)
    prompts = [TINY_PROMPT[:rng.randint(3, 11)] + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
               for _ in range(24)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = [o.outputs[0].token_ids
                for o in tiny_llm(target, num_kv_blocks=40, block_size=4).generate(prompts, params, use_tqdm=False)]
    llm = tiny_llm(target, **options)
    engine, bm = llm.engine, llm.engine.block_manager
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    aborted = {"3", "10", "17"}
    done = {}
    for step in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0].token_ids
        if step == 6:
            for request_id in aborted:
                engine.abort_request(request_id)
        for seq in engine.scheduler.running:
            assert len(seq.block_table) == bm.blocks_needed(seq.num_computed_tokens), "rejected drafts' blocks kept"
            for i in range(len(seq.block_hashes)):
                block = bm.blocks[seq.block_table[i]]
                if block.hash is not None:
                    assert block.token_ids == tuple(seq.token_ids[i * 4:(i + 1) * 4])
    assert engine.scheduler.num_preemptions > 0 and bm.prefix_hits > 0
    assert engine.stats().spec_accepted_tokens > 0
    for i, tokens in enumerate(expected):
        if str(i) not in aborted:
            assert done[str(i)] == tokens, f"request {i}"
    assert bm.num_free_blocks == bm.num_blocks
    if method == "draft":
        assert engine.drafter.block_manager.num_free_blocks == engine.drafter.block_manager.num_blocks


def test_metrics_export_the_draft_counters():
    stats = EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0, spec_draft_tokens=40, spec_accepted_tokens=25)
    text = Metrics(lambda: stats).render().decode()
    assert "kaon_spec_decode_draft_tokens_total 40.0" in text
    assert "kaon_spec_decode_accepted_tokens_total 25.0" in text


def test_kaon_serve_flags_reach_the_engine_config():
    from kaon_runtime.cli import build_parser, speculative_options
    from kaon_runtime.config import EngineConfig
    args = build_parser().parse_args(["serve", "--speculative-method", "draft", "--num-speculative-tokens", "6",
                                      "--speculative-draft-model", "/models/small"])
    config = EngineConfig(**speculative_options(args))
    assert (config.speculative_method, config.num_speculative_tokens, config.speculative_draft_model) == \
        ("draft", 6, "/models/small")
    assert EngineConfig(**speculative_options(build_parser().parse_args(["serve"]))).speculative_method == "none"


def test_logprobs_of_kept_drafts_equal_plain_decoding(tiny_dirs):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    plain = tiny_llm(tiny_dirs[0]).generate([TINY_PROMPT], params, use_tqdm=False)[0].outputs[0]
    spec_llm = tiny_llm(tiny_dirs[0], **TINY_OPTIONS["ngram"])
    spec = spec_llm.generate([TINY_PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert spec_llm.engine.stats().spec_accepted_tokens > 0
    assert spec.token_ids == plain.token_ids and len(spec.logprobs) == 10
    for ours, theirs in zip(spec.logprobs, plain.logprobs):
        assert ours.keys() == theirs.keys()
        assert all(abs(ours[t] - theirs[t]) < 1e-9 for t in ours)
