"""Mixture-of-experts models answer alike alone, batched, chunked and cached (issue 49 §2): Mixtral and Qwen3-MoE
run their expert layers inside the fused C step, each row routed alone (models/cpu_decode_step.py). Before, their
steps took torch's path, where an expert's rows are gathered per step and multiplied together, so a token's
numbers depended on its neighbours: on these tiny models every row's hidden state moved by ~1e-5 between alone
and batched (float32, int8 and int4 experts alike; tests/unit/runtime/kernels/test_cpu_decode_moe.py).

Tiny transformers-written Mixtral and Qwen3-MoE directories (support/quantized_moe_dirs.py's shape): in the
model's float32, in bfloat16, under --quantization int8 (the attention's projections int8, the experts float),
a Qwen3-MoE with a dense layer among its MoE layers, and a GPTQ 4-bit checkpoint whose experts are kaon's int4
linears (read by the step's narrow kernels)."""
from __future__ import annotations

import pytest
import torch
from test_quant import _assert_the_c_step_answers_alike_alone_batched_chunked

from kaon_runtime import LLM, SamplingParams
from kaon_runtime.kernels import cpu_decode
from kaon_runtime.layers.moe import SparseMoE
from support.hf_dirs import write_hf_dir
from support.quantized_moe_dirs import FAMILIES, SHAPE, TOKENIZER, write_packed_moe_dir

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(cpu_decode.compiler() is None, reason=cpu_decode.NO_COMPILER)

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
CASES = {  # id -> (family, config overrides, engine options, GPTQ bits or None)
    "mixtral": ("mixtral", {}, {}, None),
    "mixtral-bfloat16": ("mixtral", {}, dict(dtype="bfloat16"), None),
    "mixtral-int8": ("mixtral", {}, dict(quantization="int8"), None),
    "qwen3_moe-dense-layer-1": ("qwen3_moe", dict(mlp_only_layers=[1], norm_topk_prob=False), {}, None),
    "qwen3_moe-gptq-int4": ("qwen3_moe", {}, {}, 4),
}


def _write(case: str, path, gguf_path) -> None:
    family, overrides, _, bits = CASES[case]
    if bits is not None:
        write_packed_moe_dir(path, gguf_path, family, "gptq", bits, 32, False)
        return
    prefix, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, f"{prefix}Config")(**SHAPE, **{**extra, **overrides})
    write_hf_dir(getattr(transformers, f"{prefix}ForCausalLM")(config).eval(), path, gguf_path, TOKENIZER)


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_moe_model_answers_alike_alone_batched_chunked_and_cached(case, tmp_path, gguf_path, monkeypatch):
    for name in ("KAON_CPU_PREFILL", "KAON_CPU_DECODE", "KAON_CPU_ACTIVATIONS", "KAON_QUANT_KERNEL"):
        monkeypatch.delenv(name, raising=False)
    _write(case, tmp_path / "model", gguf_path)
    options = CASES[case][2]

    def engine(**more):
        llm = LLM(str(tmp_path / "model"), show_progress=False, device="cpu", kv_cache_bytes=1 << 22, block_size=8,
                  **options, **more)
        moes = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE)]
        assert len(moes) == (1 if "dense" in case else 2)
        assert all((m.quantized is not None) == ("gptq" in case) for m in moes)
        return llm

    _assert_the_c_step_answers_alike_alone_batched_chunked(engine, PARAMS)
