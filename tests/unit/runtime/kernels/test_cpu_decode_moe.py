"""Mixture-of-experts layers (Mixtral, Qwen3-MoE) inside the fused C step (cpu_decode.c experts_mlp): each row
routed alone (the router's logits and softmax in float32, top-k, renormalised or not), its chosen experts'
gate|up and down through the step's projection kernels, their outputs weighted and summed in the chosen order.

Against torch's path (layers/moe.py: route, moe_ref, QuantizedExperts) on tiny random MoE models, within float32's
rounding: float experts (the stacks w13 / w2 read in place), and the per-expert quantized linears a quantized
checkpoint's experts become (kaon's int8 and int4: the reference fed the int8 activation blocks the C kernels
see). And batch invariance: every row of a step gets the same bits alone as batched beside rows that share its
experts, in float32, in a bfloat16 model and with quantized experts."""
from __future__ import annotations

import pytest
import torch

from kaon_runtime.kernels import cpu_decode
from kaon_runtime.kernels.quant_gemm_ref import quantize_activations_ref
from kaon_runtime.layers.attention import AttentionMetadata
from kaon_runtime.layers.moe import SparseMoE
from kaon_runtime.models.cpu_decode_step import unsupported
from kaon_runtime.quant.int4 import Int4Linear, quantize_int4
from kaon_runtime.quant.int8 import Int8Linear, quantize_int8

pytestmark = pytest.mark.skipif(cpu_decode.compiler() is None, reason=cpu_decode.NO_COMPILER)

from test_cpu_decode import (  # noqa: E402  (after the skip: the helpers build the library)
    BLOCK,
    assert_same_cache,
    c_step_error_against_torch,
    mixed_step,
    random_model,
    tiny_config,
)

# Four experts of width 64, two chosen per row; Qwen3-MoE's options: renormalised or not, a dense layer among them.
MOES = {"mixtral": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True),
        "qwen3_moe-dense-layer-1": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                        norm_topk_prob=False, dense_layers=(1,), qk_norm=True),
        "top-3-of-5": dict(num_experts=5, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True)}


def moe_layers(model) -> list[SparseMoE]:
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def quantize_experts(model, method: str) -> list[torch.nn.Module]:
    """Each MoE layer's experts as kaon's per-expert quantized linears (QuantizedExperts: what a quantized
    checkpoint's experts become), their float stacks dropped; returns the linears."""
    linears = []
    for moe in moe_layers(model):
        if method == "int8":
            make = lambda w: Int8Linear(*quantize_int8(w))  # noqa: E731
        else:
            make = lambda w: Int4Linear(quantize_int4(w, 32))  # noqa: E731
        gate_up = [make(moe.w13[e].detach()) for e in range(moe.w13.shape[0])]
        down = [make(moe.w2[e].detach()) for e in range(moe.w2.shape[0])]
        moe.keep_experts_quantized(gate_up, down)
        linears += gate_up + down
    return linears


@pytest.mark.parametrize("moe", sorted(MOES))
def test_an_moe_decode_step_matches_the_torch_path(moe):
    config = tiny_config(**MOES[moe])
    model, _ = random_model(config, blocks=10)
    assert len(moe_layers(model)) == (1 if config.dense_layers else 2)
    assert c_step_error_against_torch(model, config) < 1e-5  # (4e-7 here; an expert's rows mixed up: ~1)


@pytest.mark.parametrize("moe", sorted(MOES))
def test_an_moe_mixed_step_matches_the_torch_path(moe):
    """Decode rows and a new prompt's rows in one step: each prompt row is routed alone too."""
    config = tiny_config(**MOES[moe])
    model, cache = random_model(config, blocks=10)
    x, positions, meta = mixed_step(config)
    model.check_kernels()
    step = model.model.cpu_decode
    assert step.applies(x, meta)
    with torch.inference_mode():
        model.model.cpu_decode = None
        expected, expected_cache = model.model(x.clone(), positions, meta), cache.clone()
        model.model.cpu_decode = step
        out = model.model(x.clone(), positions, meta)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    assert_same_cache(cache, expected_cache)


@pytest.mark.parametrize("activations", ["int8", "int8x2"])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_experts_match_their_reference(method, activations, monkeypatch):
    """A quantized checkpoint's experts (per-expert int8 / int4 linears) through the C step's narrow kernels,
    against torch's QuantizedExperts fed the activations those kernels see (int8 blocks, one pass or two)."""
    monkeypatch.setenv("KAON_QUANT_KERNEL", "torch")
    monkeypatch.setenv("KAON_CPU_ACTIVATIONS", activations)
    config = tiny_config(**MOES["mixtral"])
    model, _ = random_model(config, blocks=10)
    linears = quantize_experts(model, method)
    assert all(moe.quantized is not None for moe in moe_layers(model))
    passes = cpu_decode.activation_passes()
    error = c_step_error_against_torch(model, config, linears, lambda x: quantize_activations_ref(x, passes=passes))
    assert error < {"int8": 1e-4, "int8x2": 1e-3}[activations]


def many_decodes(config, n: int):
    """n one-block sequences (block i, 1..BLOCK tokens): enough rows that experts are shared by several."""
    torch.manual_seed(5)
    lens = [1 + i % BLOCK for i in range(n)]
    positions = torch.tensor([m - 1 for m in lens])
    slots = torch.tensor([i * BLOCK + m - 1 for i, m in enumerate(lens)])
    tables = torch.arange(n)[:, None]
    meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=n, decode_block_tables=tables,
                             decode_context_lens=torch.tensor(lens))
    return torch.randn(n, config.hidden_size), positions, meta


def one_row(meta: AttentionMetadata, i: int) -> AttentionMetadata:
    assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
    return AttentionMetadata(slot_mapping=meta.slot_mapping[i:i + 1], num_decode_tokens=1,
                             decode_block_tables=meta.decode_block_tables[i:i + 1],
                             decode_context_lens=meta.decode_context_lens[i:i + 1])


@pytest.mark.parametrize("experts", ["float32", "bfloat16", "int8", "int4"])
def test_a_row_gets_the_same_bits_alone_or_beside_rows_sharing_its_experts(experts):
    """Twelve rows, four experts, two each: every expert serves several rows of the batch and one row alone."""
    config = tiny_config(**MOES["qwen3_moe-dense-layer-1"])
    kv_dtype = torch.bfloat16 if experts == "bfloat16" else torch.float32
    model, _ = random_model(config, blocks=12, kv_dtype=kv_dtype)
    if experts == "bfloat16":
        model.to(torch.bfloat16)  # (the pool stays attached: the attention layers hold it as plain attributes)
    elif experts != "float32":
        quantize_experts(model, experts)
    model.check_kernels()
    x, positions, meta = many_decodes(config, 12)
    x = x.to(kv_dtype)
    with torch.inference_mode():
        batched = model.model(x.clone(), positions, meta)
        for i in range(x.shape[0]):
            alone = model.model(x[i:i + 1].clone(), positions[i:i + 1], one_row(meta, i))
            assert torch.equal(alone[0], batched[i]), f"row {i}"


def test_what_it_runs_and_what_it_names():
    assert unsupported(tiny_config(**MOES["mixtral"])) is None
    assert unsupported(tiny_config(**MOES["qwen3_moe-dense-layer-1"])) is None
    # (experts 48 wide: test_cpu_decode_oddquant.py)
    assert unsupported(tiny_config(**dict(MOES["mixtral"], moe_intermediate_size=48))) is None
