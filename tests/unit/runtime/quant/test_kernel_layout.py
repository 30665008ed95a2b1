"""Quantized weights held once (issue 49; quant/kernel_layout.py): an int8 or int4 (groups of 32) linear the fused CPU
step reads hands it its tensors and keeps only the step's interleaved copy, and everything that still runs the module
itself (torch's path, a tied lookup) reads that copy and computes what it computed before."""
from __future__ import annotations

import pytest
import torch

from kaon_runtime.engine import sleep
from kaon_runtime.kernels import cpu_decode
from kaon_runtime.kernels.quant_gemm_cpu import DENSE_ROWS, w4_dense_cpu
from kaon_runtime.models.fused_weights import hold_kernel_layout, linear_weights
from kaon_runtime.quant.group_int8 import GroupInt8Linear, dequantize_group_int8, quantize_group_int8
from kaon_runtime.quant.int4 import Int4Linear, quantize_int4
from kaon_runtime.quant.int8 import Int8Linear, quantize_int8

N, K = 44, 96  # N not a multiple of the kernel's eight lanes: the padded rows must not show


def _module(kind: str, bias: bool = True, k: int = K) -> torch.nn.Module:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(N, k, generator=g) * 0.05
    b = torch.randn(N, generator=g) if bias else None
    if kind == "int8":
        return Int8Linear(*quantize_int8(weight), b)
    quantized = quantize_int4(weight, 32, pad=True)
    if kind == "int4-f32":  # a GPTQ / AWQ / compressed-tensors weight's float32 scales and mins (Q4_F32)
        quantized.scales, quantized.mins = quantized.scales.float(), quantized.mins.float()
    return Int4Linear(quantized, b)


def _pair(kind: str, k: int = K) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same weights twice: as loaded, and held in the kernel's layout."""
    own, held = _module(kind, k=k), _module(kind, k=k)
    assert hold_kernel_layout(held)
    return own, held


def _bytes(module: torch.nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in module.buffers())


@pytest.mark.parametrize("kind", ["int8", "int4", "int4-f32"])
def test_the_step_reads_the_modules_only_copy(kind):
    own, held = _pair(kind)
    struct = linear_weights(held)
    assert {t.data_ptr() for name, t in struct.named().items() if name != "bias"} <= \
        {b.data_ptr() for b in held.buffers()}  # the step's pointers are the module's buffers
    assert _bytes(held) < 1.25 * _bytes(own)  # one copy (its rows padded to eight), not the module's and the step's
    assert not {"qweight", "packed"} & set(dict(held.named_buffers()))
    x = torch.randn(5, K)
    assert torch.equal(cpu_decode.linear(struct, x), cpu_decode.linear(linear_weights(own), x))  # the same kernel input


@pytest.mark.parametrize("kind", ["int8", "int4", "int4-f32"])
def test_torchs_path_reads_the_held_copy(kind):
    own, held = _pair(kind)
    many = torch.randn(DENSE_ROWS + 3, K)
    assert torch.equal(held(many), own(many))  # the dense GEMM over the same plain layout, rebuilt
    few = torch.randn(3, K)
    if kind == "int8":  # torch's packed int8 kernel, as before
        assert torch.equal(held(few), own(few))
    else:  # the dense GEMM (torch's packed int4 kernel would need a layout of its own: a second copy)
        weight = own.int4_weight()
        assert torch.equal(held(few), w4_dense_cpu(few, weight.packed, weight.scales, weight.mins, 32) + own.bias)
        assert torch.allclose(held(few), own(few), rtol=0.02, atol=0.02)
    for module in (own, held):
        module.reference = True  # the reference arithmetic: the same dequantized weight
    assert torch.equal(held(few), own(few))


def test_a_tied_lookup_reads_the_held_rows_and_the_weight_comes_back():
    own, held = _pair("int8")
    ids = torch.tensor([N - 1, 0, 9, 9, 17])
    assert torch.equal(held.rows(ids), own.rows(ids))
    assert all(torch.equal(a, b) for a, b in zip(held.int8_weight(), own.int8_weight(), strict=True))
    for kind in ("int4", "int4-f32"):
        own4, held4 = _pair(kind)
        a, b = held4.int4_weight(), own4.int4_weight()
        assert torch.equal(a.packed, b.packed) and torch.equal(a.scales, b.scales) and torch.equal(a.mins, b.mins)


def test_what_the_step_does_not_read_keeps_its_own_layout():
    group_64 = Int4Linear(quantize_int4(torch.randn(16, 128), 64))
    reference = _module("int8")
    reference.reference = True  # the reference mode reads the module's own layout in place
    for module in (group_64, reference):
        assert not hold_kernel_layout(module) and getattr(module, "kernel_weights", None) is None


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_width_that_is_not_whole_blocks_is_held_once_too(kind):
    """K = 48: the held copy is packed with zero columns to 64 (int8) or quantized to whole groups (int4,
    quantize_int4's pad); torch's path, the tied lookup and the plain weight read it back at the true width."""
    own, held = _pair(kind, k=48)
    assert linear_weights(held).struct.k_in == 48 and held.in_features == 48
    assert _bytes(held) < 1.5 * _bytes(own)  # (int8: 64 / 48 of the weight; int4 pads before holding)
    for x in (torch.randn(DENSE_ROWS + 3, 48), torch.randn(3, 48)):
        expected = own(x)
        if kind == "int4" and x.shape[0] < DENSE_ROWS:  # (held int4's few rows take the dense GEMM, as above)
            weight = own.int4_weight()
            expected = w4_dense_cpu(torch.nn.functional.pad(x, (0, 16)), weight.packed, weight.scales, weight.mins,
                                    32) + own.bias
        assert torch.equal(held(x), expected)
    if kind == "int8":
        ids = torch.tensor([N - 1, 0, 9])
        assert torch.equal(held.rows(ids), own.rows(ids))
        assert all(torch.equal(a, b) for a, b in zip(held.int8_weight(), own.int8_weight(), strict=True))
    else:
        a, b = held.int4_weight(), own.int4_weight()
        assert torch.equal(a.packed, b.packed) and torch.equal(a.scales, b.scales) and a.in_features == 48


@pytest.mark.parametrize("mins", [False, True])
def test_group_int8_at_a_width_that_is_not_whole_blocks_is_held_once(mins):
    """K = 48 in groups of 16 (a GPTQ / compressed-tensors 8-bit checkpoint's, or GGUF's): the module holds only the
    step's Q8_G16 layout, packed with a zero group to 64, and the step reads those very buffers. Before, such a
    module kept its own [N, 48] tensors and the step made its padded copy beside them (the bytes counted here were
    then 2.3x the weight's); its weight, rows and products read back at the true width."""
    g = torch.Generator().manual_seed(1)
    weight = quantize_group_int8(torch.randn(N, 48, generator=g) * 0.05, 16)
    if mins:
        weight.mins = torch.randn(N, 3, generator=g) * 0.01
    bias = torch.randn(N, generator=g)
    module = GroupInt8Linear(weight, bias)
    struct = linear_weights(module)
    assert (struct.struct.k, struct.struct.k_in, module.in_features) == (64, 48, 48)
    buffers = {b.data_ptr() for b in module.buffers()}
    assert {t.data_ptr() for name, t in struct.named().items() if name != "bias"} <= buffers  # no copy beside
    held = {t.data_ptr(): t.numel() * t.element_size() for t in [*module.buffers(), *struct.tensors]}
    plain = sum(t.numel() * t.element_size() for t in (weight.qweight, weight.scales, weight.mins, bias)
                if t is not None)
    assert sum(held.values()) < 1.5 * plain  # one copy: 64 / 48 of the weight, its rows padded to eight
    back = module.weight
    assert torch.equal(back.qweight, weight.qweight) and torch.equal(back.scales, weight.scales.float())
    assert (back.mins is None) == (not mins) and (not mins or torch.equal(back.mins, weight.mins))
    ids = torch.tensor([N - 1, 0, 9, 9])
    assert torch.equal(module.rows(ids), dequantize_group_int8(weight)[ids])
    few = torch.randn(3, 48, generator=g)
    expected = torch.nn.functional.linear(few.double(), dequantize_group_int8(weight).double(), bias.double())
    assert torch.allclose(module(few).double(), expected, rtol=0.02, atol=0.02)  # (int8 activation blocks)
    many = torch.randn(DENSE_ROWS + 3, 48, generator=g)
    expected = torch.nn.functional.linear(many.double(), dequantize_group_int8(weight).double(), bias.double())
    assert torch.allclose(module(many).double(), expected, rtol=0.02, atol=0.02)  # (the dense GEMM's dtype)


@pytest.mark.parametrize("kind", ["int8", "int4", "group-int8"])
def test_sleep_level_two_maps_the_held_copy_back_where_the_step_reads_it(kind, tmp_path, monkeypatch):
    """Level 2 swaps every buffer's storage (written out, mapped back): a struct made before pointed at freed memory.
    The group-int8 linear held its layout from the start and had this bug too (its few-row matmul's struct)."""
    if kind == "group-int8":
        module: torch.nn.Module = GroupInt8Linear(quantize_group_int8(torch.randn(N, K), 32), torch.randn(N))
        own = GroupInt8Linear(module.weight, module.bias)
    else:
        own, module = _pair(kind)
    x = torch.randn(3, K)
    before, before_step = module(x), cpu_decode.linear(linear_weights(module), x)
    spill = sleep._spill(module, str(tmp_path))
    assert spill is not None
    torch.randn(4 * N, K).add_(1)  # something else in the memory the weights left
    sleep._unspill(module, spill)
    read: list[int] = []
    linear = cpu_decode.linear
    monkeypatch.setattr(cpu_decode, "linear", lambda weights, x: read.append(weights.struct.w) or linear(weights, x))
    buffers = {b.data_ptr() for b in module.buffers()}
    assert linear_weights(module).struct.w in buffers
    assert torch.equal(module(x), before)
    if kind == "group-int8":  # its few-row matmul goes through a struct too (int8 / int4 rebuild the plain layout)
        assert read and set(read) <= buffers and torch.equal(cpu_decode.linear(linear_weights(module), x), before_step)
    assert torch.equal(before_step, cpu_decode.linear(linear_weights(own), x))  # (and it was the weight's product)


def test_an_int8_head_holds_the_table_its_logits_and_tied_lookup_read():
    from kaon_runtime.layers.vocab import VocabHead

    head = VocabHead(K, 100, cpu_logits_rows=64)  # every logits row through the C kernel (the fused step is on)
    with torch.no_grad():
        head.weight_t.normal_(0, 0.05)
    head.quantized = Int8Linear(*quantize_int8(head.weight_t.detach().t()))
    head.drop_float_table()  # tied: the lookup reads the int8 table too
    hidden, ids = torch.randn(3, K), torch.tensor([99, 0, 41])
    logits, rows = head(hidden), head.embed(ids)
    assert head.hold_kernel_layout()
    assert "qweight" not in dict(head.named_buffers())
    assert torch.equal(head(hidden), logits) and torch.equal(head.embed(ids), rows)
    assert head.cpu_weights().struct.w == head.quantized.kernel_w.data_ptr()  # its logits read the held copy
