"""A float or int8 model whose widths are not whole blocks of 32 (hidden 48, MLP 80, head_dim 12) is served by the
fused C step (models/cpu_decode_step.any_width), so its answers do not depend on batch neighbours, chunked
prefill or a cached prefix (issue 49 §2); before, the blocker sent it to torch's GEMMs."""
from __future__ import annotations

import pytest

from kaon_runtime import LLM, SamplingParams
from kaon_runtime.kernels import cpu_decode
from support.hf_dirs import write_hf_dir
from support.tiny_llama import PROMPTS

pytestmark = pytest.mark.slow  # a whole engine, twice

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def odd_llama(tmp_path_factory, gguf_path):
    import torch
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("odd-llama")
    write_hf_dir(transformers.LlamaForCausalLM(config), path, gguf_path,
                 {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    return str(path)


def _answers(outputs) -> list[tuple[list[int], list[float]]]:
    return [(o.outputs[0].token_ids, [step[t] for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outputs]


# float32 weights, int8's and int4's (narrow kinds packed to whole blocks of 32, their inputs zero-padded: Linear.k_in)
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_an_odd_width_model_takes_the_c_step_and_answers_alike_alone_or_batched(odd_llama, quantization):
    # Batches of at most 32 tokens: the 74-token prompt is prefilled in chunks while the others decode.
    llm = LLM(odd_llama, show_progress=False, device="cpu", dtype="float32", block_size=8,
              max_num_batched_tokens=32, quantization=quantization)
    model = llm.engine.runner.model
    assert model.model.cpu_decode is not None, "the C step serves it"
    if quantization == "int8":  # the projections and the head through the padded int8 kind, held once
        assert model.lm_head.cpu_weights().struct.kind == cpu_decode.KIND_INT8
        assert model.lm_head.cpu_weights().struct.k_in == 48
        assert model.model.layers[0].mlp.down_proj.kernel_weights.struct.k_in == 80
    if quantization == "int4":  # Q4_1 packed to whole groups of 32 (quant/int4.py), held once
        assert model.model.layers[0].mlp.down_proj.kernel_weights.struct.kind == cpu_decode.KIND_Q4_1
        assert model.model.layers[0].mlp.down_proj.kernel_weights.struct.k_in == 80
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    alone = [_answers(llm.generate([p], params, use_tqdm=False))[0] for p in PROMPTS]
    assert _answers(llm.generate(PROMPTS, params, use_tqdm=False)) == alone  # neighbours, chunks, cached prefix
