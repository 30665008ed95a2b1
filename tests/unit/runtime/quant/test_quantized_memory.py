"""Quantized weights held once: a group-int8 linear on CPU keeps only the fused kernel's layout (the
struct the decode step reads points at the module's own buffers), a tied vocabulary table becomes one
int8 table that both the logits and the token lookup read (no float table left), and a GGUF Q8_0
table comes back from it exactly."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kaon_runtime.config import ModelConfig
from kaon_runtime.models.decoder import DecoderForCausalLM
from kaon_runtime.models.fused_weights import linear_weights
from kaon_runtime.quant import quantize_model
from kaon_runtime.quant.group_int8 import (
    GroupInt8Linear,
    GroupInt8Weight,
    dequantize_group_int8,
    quantize_group_int8,
)
from kaon_runtime.quant.int8 import Int8Linear


def _weight(rows: int, k: int, group: int, mins: bool) -> GroupInt8Weight:
    g = torch.Generator().manual_seed(rows + k + group)
    q = torch.randint(-128, 128, (rows, k), generator=g, dtype=torch.int8)
    scales = torch.rand(rows, k // group, generator=g) * 0.01
    return GroupInt8Weight(q, scales, torch.randn(rows, k // group, generator=g) * 0.01 if mins else None, group)


@pytest.mark.parametrize("rows,group,mins", [(32, 16, False), (13, 32, True), (8, 128, True)])
def test_the_kernel_layout_is_the_only_copy_and_gives_the_weight_back(rows, group, mins):
    given = _weight(rows, 256, group, mins)
    layer = GroupInt8Linear(given)
    assert layer.kernel_weights is not None
    buffers = {b.data_ptr() for b in layer.buffers()}
    assert {t.data_ptr() for t in linear_weights(layer).tensors} <= buffers  # the step reads the module's own
    assert sum(b.numel() * b.element_size() for b in layer.buffers()) < 2 * rows * 256  # not two int8 copies
    assert torch.equal(dequantize_group_int8(layer.weight), dequantize_group_int8(given))
    ids = torch.tensor([rows - 1, 0, rows // 2, 0])
    assert torch.equal(layer.rows(ids), dequantize_group_int8(given)[ids])


def test_a_q8_0_table_comes_back_exactly():
    gguf = pytest.importorskip("gguf")
    floats = (np.random.default_rng(0).standard_normal((64, 128)) * 0.05).astype(np.float32)
    blocks = gguf.quants.quantize(floats, gguf.GGMLQuantizationType.Q8_0)
    q8_0 = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0).astype(np.float32))
    assert torch.equal(dequantize_group_int8(quantize_group_int8(q8_0)), q8_0)


def _tied_model(q8_0: bool) -> DecoderForCausalLM:
    config = ModelConfig(architecture="llama", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = DecoderForCausalLM(config)
    with torch.no_grad():
        table = torch.randn(64, 96)
        if q8_0:  # what a GGUF's Q8_0 table dequantizes to
            table = dequantize_group_int8(quantize_group_int8(table.t())).t()
        model.lm_head.weight_t.copy_(table)
    return model


def test_a_q8_0_tied_table_is_one_int8_table_for_logits_and_lookup():
    model = _tied_model(q8_0=True)
    table = model.lm_head.weight_t.detach().t().clone()
    ids = torch.tensor([3, 95, 0, 3])
    quantize_model(model, "int8")
    head = model.lm_head
    assert head.weight_t is None and isinstance(head.quantized, GroupInt8Linear)
    assert torch.equal(head.embed(ids), table[ids])
    assert torch.equal(dequantize_group_int8(head.quantized.weight), table)


def test_any_other_tied_table_keeps_its_float_lookup():
    model = _tied_model(q8_0=False)
    table = model.lm_head.weight_t.detach().t().clone()
    quantize_model(model, "int4")
    assert isinstance(model.lm_head.quantized, Int8Linear)
    assert torch.equal(model.lm_head.embed(torch.tensor([5, 1])), table[[5, 1]])
