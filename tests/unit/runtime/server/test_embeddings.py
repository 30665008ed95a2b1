"""Embeddings through the engine (engine/pooling.py): a prompt's final hidden states pooled as
transformers computes them, batched with other requests, across chunked prefill and prefix-cache
hits; and the server's pure parts (server/embeddings.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kaon_runtime import LLM, SamplingParams
from support.embed_model import build_embed_dir, reference_embedding

transformers = pytest.importorskip("transformers")

PROMPTS = [list(range(100, 190)), list(range(100, 140)) + [7, 8, 9], [42], list(range(300, 317))]


@pytest.fixture(scope="module")
def embed_model(tmp_path_factory, gguf_path):
    path = tmp_path_factory.mktemp("qwen3-embed")
    return str(path), build_embed_dir(path, gguf_path)


def embed(llm: LLM, prompts, pooling: str) -> list[torch.Tensor]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=0, pooling=pooling), use_tqdm=False)
    assert all(o.outputs[0].token_ids == [] and o.finished for o in outs)
    return [F.normalize(torch.tensor(o.embedding), dim=0) for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_pooled_hidden_states_equal_transformers(embed_model, pooling):
    path, hf = embed_model
    # 32 tokens a step: the 90-token prompt is pooled across three chunks; the second prompt
    # shares its first 40 tokens, which last-token pooling takes from the prefix cache.
    llm = LLM(path, show_progress=False, device="cpu", dtype="float32", max_num_batched_tokens=32)
    embed(llm, PROMPTS[:1], pooling)
    got = embed(llm, PROMPTS, pooling)
    for prompt, vector in zip(PROMPTS, got):
        expected = reference_embedding(hf, prompt, pooling)
        assert F.cosine_similarity(vector, expected, dim=0) >= 0.9999
        torch.testing.assert_close(vector, expected, atol=1e-4, rtol=1e-4)
    stats = llm.engine.stats()
    assert (stats.prefix_cache_hits > 0) == (pooling == "last")  # mean pooling computes every position
    llm.close()


def test_pooling_is_checked_and_allows_max_tokens_0():
    from kaon_runtime.errors import InvalidRequestError

    SamplingParams(max_tokens=0, pooling="mean")
    with pytest.raises(InvalidRequestError, match="pooling"):
        SamplingParams(max_tokens=0, pooling="cls")
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_the_checkpoint_pooling_config_picks_mean_or_last(tmp_path):
    import json

    from kaon_runtime.engine.pooling import pooling_of_checkpoint
    assert pooling_of_checkpoint(str(tmp_path)) == "last"  # no sentence-transformers config
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    assert pooling_of_checkpoint(str(tmp_path)) == "mean"
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    assert pooling_of_checkpoint(str(tmp_path)) == "last"


def test_dimensions_only_where_the_checkpoint_says_matryoshka(tmp_path):
    import json

    from kaon_runtime.engine.pooling import matryoshka_of_checkpoint
    from kaon_runtime.errors import InvalidRequestError
    from kaon_runtime.server.embeddings import check_dimensions, encode

    assert matryoshka_of_checkpoint(str(tmp_path)) is False
    (tmp_path / "config.json").write_text(json.dumps({"is_matryoshka": True}))
    assert matryoshka_of_checkpoint(str(tmp_path)) is True
    (tmp_path / "config.json").write_text(json.dumps({"matryoshka_dimensions": [32, 64]}))
    assert matryoshka_of_checkpoint(str(tmp_path)) == [32, 64]
    check_dimensions(None, 64, False)
    check_dimensions(64, 64, False)
    check_dimensions(16, 64, True)
    check_dimensions(32, 64, [32, 64])
    for dimensions, matryoshka in [(32, False), (65, True), (16, [32, 64])]:
        with pytest.raises(InvalidRequestError, match="dimensions"):
            check_dimensions(dimensions, 64, matryoshka)
    # Cut first, then normalized: the first two of (3, 4, 12) are (0.6, 0.8).
    assert encode([3.0, 4.0, 12.0], True, "float", 2) == pytest.approx([0.6, 0.8])
    assert encode([3.0, 4.0, 12.0], False, "float") == [3.0, 4.0, 12.0]
