"""LLM.generate from several threads at once, and after an interrupted call (sweep49).

Each call used to step the shared engine on its own and keep every finished output it saw, so two threads
took each other's outputs: one failed with a KeyError, another inside the model (two steps at once), and a
call after a Ctrl-C counted the interrupted call's outputs as its own. Now the calls share the engine one
step at a time, each finished output goes to its caller (the threads' requests batched together), and an
interrupted call aborts what it had left.
"""
from __future__ import annotations

import threading

import pytest

from kaon_runtime import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with LLM(tiny_llama, show_progress=False, device="cpu", dtype="float32") as engine:
        yield engine


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_generate_from_several_threads_gives_each_its_own_answers(llm):
    asks = {k: ([[5, 6, 7 + k], [9, 10 + k]], _greedy(2 + 3 * k)) for k in range(3)}
    expected = {k: _tokens(llm.generate(prompts, params, use_tqdm=False)) for k, (prompts, params) in asks.items()}
    got: dict[int, object] = {}

    def ask(k: int) -> None:
        try:
            got[k] = _tokens(llm.generate(*asks[k], use_tqdm=False))
        except Exception as error:  # noqa: BLE001 - the assertion below shows it
            got[k] = repr(error)

    threads = [threading.Thread(target=ask, args=(k,)) for k in asks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert got == expected


def test_an_interrupted_generate_leaves_nothing_for_the_next_call(llm, monkeypatch):
    expected = _tokens(llm.generate([[5, 6, 7]], _greedy(6), use_tqdm=False))
    step, steps = llm.engine.step, []

    def interrupted(*args, **kwargs):  # Ctrl-C arriving after a few steps of a long generation
        steps.append(1)
        if len(steps) == 3:
            raise KeyboardInterrupt
        return step(*args, **kwargs)

    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[11, 12, 13]], _greedy(5), use_tqdm=False)
    monkeypatch.undo()
    # the interrupted request would finish first: it used to be taken for this call's (a KeyError)
    assert _tokens(llm.generate([[5, 6, 7]], _greedy(6), use_tqdm=False)) == expected
    assert not llm.engine.has_unfinished_requests()
