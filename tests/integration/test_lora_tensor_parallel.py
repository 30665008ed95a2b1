"""LoRA under tensor parallelism (CPU, gloo): A cut like each projection's input, B like its output.

Two ranks serve the base and several adapters mixed in one batch, through the fused C step, with fewer
slots than adapters (so slots are loaded again mid-run, on every rank), plus an adapter loaded and
unloaded at run time: each request's greedy tokens equal transformers + peft with its adapter merged,
in float32.
"""
from __future__ import annotations

import pytest
import torch

from kaon_runtime import LLM, SamplingParams
from kaon_runtime.config import ModelConfig
from kaon_runtime.distributed.lora_sharding import cut_lora
from kaon_runtime.errors import ModelNotFoundError

pytest.importorskip("transformers")
pytest.importorskip("peft")

from support.lora_adapters import ADAPTERS, build_adapters, build_base, greedy, merged

PROMPTS = [list(range(100, 120)), list(range(300, 305)), list(range(1000, 1040)), list(range(7, 30)),
           list(range(100, 120))]
NAMES = [None, "attn", "mlp", "all", "attn"]


def test_the_shards_of_an_adapter_add_up_to_its_whole_change():
    """Column-parallel: each rank's rows of x A^T B^T; row-parallel: partial sums over the ranks'
    input columns. One KV head per two ranks: both ranks hold the same k rows."""
    config = ModelConfig("llama", 50, 64, 96, 2, 4, 1, 16, 128)
    shapes = {"q_proj": (64, 64), "k_proj": (64, 16), "o_proj": (64, 64), "up_proj": (64, 96),
              "down_proj": (96, 64)}
    torch.manual_seed(0)
    for proj, (fan_in, fan_out) in shapes.items():
        a, b, x = torch.randn(4, fan_in), torch.randn(fan_out, 4), torch.randn(3, fan_in)
        whole = x @ a.T @ b.T
        shards = [cut_lora(proj, a, b, config, rank, 2) for rank in range(2)]
        if proj in ("o_proj", "down_proj"):
            xs = x.chunk(2, dim=1)
            assert torch.allclose(sum(xi @ ai.T @ bi.T for xi, (ai, bi) in zip(xs, shards)), whole, atol=1e-4)
        elif proj == "k_proj":
            assert all(torch.equal(bi, b) for _, bi in shards)  # the one KV head, replicated
        else:
            assert torch.allclose(torch.cat([x @ ai.T @ bi.T for ai, bi in shards], dim=1), whole, atol=1e-4)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, gguf_path):
    root = tmp_path_factory.mktemp("lora-tp")
    # An MLP width two ranks split into whole blocks of 32: each rank's shard and its adapters' shares take the
    # fused C step (models/cpu_decode_step.py), the row-parallel terms summed with the base's partial sums
    base = build_base("llama", root / "base", gguf_path, intermediate_size=128)
    dirs = build_adapters(base, root, ADAPTERS)
    expected = {n: [greedy(base if n is None else merged(base, dirs[n]), p, 8) for p in PROMPTS]
                for n in [None, *dirs]}
    return root, dirs, expected


def test_two_ranks_serve_base_and_adapters_mixed_with_runtime_load_and_unload(adapters):
    root, dirs, expected = adapters
    assert len({tuple(expected[n][0]) for n in expected}) == len(expected), "each adapter must change the tokens"
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    served = {n: dirs[n] for n in ("attn", "mlp", "all")}
    llm = LLM(str(root / "base"), show_progress=False, device="cpu", dtype="float32", adapters=served,
              max_loras=2, tensor_parallel_size=2)
    try:
        step = llm.engine.runner.model.model.cpu_decode
        assert step is not None and step.reads_lora(), "the C step adds the adapters on every rank"
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False, adapter=NAMES)]
        assert got == [expected[n][i] for i, n in enumerate(NAMES)]
        assert llm.engine.runner.lora is not None and llm.engine.runner.lora.num_loads > 2  # evicted, reloaded

        llm.engine.add_lora("qv", dirs["qv"])  # at run time: every rank gets it when it takes a slot
        names = ["qv", None, "qv", "mlp", "qv"]
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False, adapter=names)]
        assert got == [expected[n][i] for i, n in enumerate(names)]

        llm.engine.remove_lora("qv")
        with pytest.raises(ModelNotFoundError):
            llm.generate(PROMPTS[:1], params, use_tqdm=False, adapter="qv")
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params, use_tqdm=False, adapter=["all", None])]
        assert got == [expected["all"][0], expected[None][1]]
    finally:
        llm.close()
