"""The GPU switch's wiring (KAON_GPU_BATCH_INVARIANT=1: layers/kernel_backend.py `batch_invariant`): the decoder's
projections, its vocabulary head and every quantized linear on the Triton path compute a row's output with the
same bits whatever the row count (kernels/invariant_gemm.py), and the default path, which does not, is untouched.

In Triton's interpreter on CPU (KAON_QUANT_KERNEL=triton takes the quantized linears' GPU path): what that proves
and what it cannot is in tests/unit/runtime/kernels/test_invariant_gemm.py's docstring. Rows are compared as
prefixes of one batch (each keeps its place in its tile; its neighbours change).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.nn import functional as F

pytest.importorskip("triton")

from kaon_runtime.config import ModelConfig
from kaon_runtime.kernels import invariant_gemm
from kaon_runtime.layers.invariant_linear import InvariantLinear
from kaon_runtime.layers.kernel_backend import torch_kernels
from kaon_runtime.layers.vocab import VocabHead
from kaon_runtime.models.decoder import DecoderForCausalLM
from kaon_runtime.quant.fp8 import Fp8Linear
from kaon_runtime.quant.fp8_block import Fp8BlockLinear
from kaon_runtime.quant.group_int8 import GroupInt8Linear, quantize_group_int8
from kaon_runtime.quant.int4 import Int4Linear
from kaon_runtime.quant.int8 import Int8Linear
from kaon_runtime.quant.invariant import use_batch_invariant_kernels
from kaon_runtime.quant.surgery import quantize_model

PREFIXES = (1, 3, 64, 70)
CONFIG = ModelConfig("llama", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4,
                     num_kv_heads=2, head_dim=16, max_position_embeddings=64)


def _moved(compute, x: torch.Tensor) -> int:
    """How many outputs of x's row prefixes differ from the whole batch's same rows."""
    full = compute(x)
    return sum(int((compute(x[:m]) != full[:m]).sum()) for m in PREFIXES)


def test_the_switch_builds_the_decoder_on_invariant_linears():
    invariant = DecoderForCausalLM(CONFIG, kernels=replace(torch_kernels(), batch_invariant=True))
    default = DecoderForCausalLM(CONFIG, kernels=torch_kernels())
    layer, plain = invariant.model.decoder_layers()[0], default.model.decoder_layers()[0]
    projections = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    assert all(type(p) is InvariantLinear for p in projections)
    assert type(plain.self_attn.qkv_proj) is nn.Linear and type(plain.mlp.down_proj) is nn.Linear
    assert invariant.lm_head is not None and invariant.lm_head.invariant
    assert default.lm_head is not None and not default.lm_head.invariant


def test_invariant_linear_is_the_linear_with_rows_of_their_own():
    torch.manual_seed(0)
    linear = InvariantLinear(200, 72, bias=True)
    x = torch.randn(70, 200)
    with torch.no_grad():
        ref = F.linear(x.double(), linear.weight.double(), linear.bias.double())
        assert (linear(x).double() - ref).abs().max() < 1e-5 * ref.abs().max()
        assert linear(x.view(7, 10, 200)).shape == (7, 10, 72)  # leading dims as nn.Linear's
        assert _moved(linear, x) == 0


def test_the_head_computes_invariant_logits():
    torch.manual_seed(1)
    head = VocabHead(64, 96, invariant=True)
    nn.init.normal_(head.weight_t)
    x = torch.randn(70, 64)
    with torch.no_grad():
        assert (head(x).double() - x.double() @ head.weight_t.double()).abs().max() < 1e-4
        assert _moved(head, x) == 0


def _quantized(kind: str) -> nn.Module:
    torch.manual_seed(2)
    linear = nn.Linear(256, 72, bias=True)
    if kind == "int4":
        return Int4Linear.from_linear(linear, 32)
    if kind == "int8":
        return Int8Linear.from_linear(linear)
    if kind == "fp8":
        return Fp8Linear.from_linear(linear)
    if kind == "fp8 blocks":
        fp8 = Fp8Linear.from_linear(linear)  # one scale per row is a block of one row by the whole K
        return Fp8BlockLinear(fp8.qweight, fp8.scales[:, None].contiguous(), (1, 256), linear.bias)
    return GroupInt8Linear(quantize_group_int8(linear.weight.detach()), linear.bias)


@pytest.mark.parametrize("kind", ["int4", "int8", "fp8", "fp8 blocks", "group int8"])
def test_marked_quantized_linears_are_row_invariant_on_the_triton_path(kind, monkeypatch):
    module = _quantized(kind)
    x = torch.randn(70, 256)
    with torch.no_grad():
        monkeypatch.setenv("KAON_QUANT_KERNEL", "torch")
        ref = module(x).double()
        monkeypatch.setenv("KAON_QUANT_KERNEL", "triton")
        module.batch_invariant = True
        out = module(x).double()
        assert (out - ref).abs().max() < 1e-5 * ref.abs().max()
        assert _moved(module, x) == 0


@pytest.mark.parametrize("kind", ["int8", "fp8"])  # int4 alike (quant_gemv, then quant_gemm): 12 s more
def test_the_default_triton_path_moves_rows_with_the_row_count(kind, monkeypatch):
    """What the switch fixes, and what the test above would see without it: a few rows take quant_gemv.py, more
    take quant_gemm.py's tiles (or F.linear), each summing in its own order."""
    monkeypatch.setenv("KAON_QUANT_KERNEL", "triton")
    module = _quantized(kind)
    with torch.no_grad():
        assert _moved(module, torch.randn(70, 256)) > 0


def test_marking_reaches_every_quantized_linear_and_the_head():
    model = DecoderForCausalLM(CONFIG, kernels=replace(torch_kernels(), batch_invariant=True))
    quantize_model(model, "int8")
    assert model.lm_head is not None and model.lm_head.quantized is not None
    assert use_batch_invariant_kernels(model) == 5  # qkv, o, gate|up, down and the head's int8 copy
    assert model.lm_head.quantized.batch_invariant
    assert not Int8Linear.batch_invariant  # the class default stays off


def test_the_kernel_module_is_what_the_head_calls(monkeypatch):
    """The head's invariant branch goes through invariant_gemm.linear (not torch's matmul)."""
    calls = []
    real = invariant_gemm.linear
    monkeypatch.setattr(invariant_gemm, "linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    head = VocabHead(64, 96, invariant=True)
    nn.init.normal_(head.weight_t)
    with torch.no_grad():
        head(torch.randn(3, 64))
    assert calls == [1]


def test_the_switch_keeps_the_invariant_linears_from_onednn():
    """On CPU (Triton's interpreter) the loader would swap float32 linears for oneDNN's without the C step: not under
    the switch, whose linears must stay the invariant GEMM's."""
    from kaon_runtime.engine.model_loader import use_onednn_where_it_applies
    from kaon_runtime.layers.cpu_linear import onednn_linears_apply
    if not onednn_linears_apply(torch.device("cpu"), torch.float32):
        pytest.skip("no oneDNN linears in this torch build")
    kernels = replace(torch_kernels(), batch_invariant=True)
    model = DecoderForCausalLM(CONFIG, kernels=kernels)
    use_onednn_where_it_applies(model, kernels, torch.device("cpu"), torch.float32)
    assert type(model.model.decoder_layers()[0].mlp.down_proj) is InvariantLinear
    default = DecoderForCausalLM(CONFIG, kernels=torch_kernels())
    use_onednn_where_it_applies(default, torch_kernels(), torch.device("cpu"), torch.float32)
    assert type(default.model.decoder_layers()[0].mlp.down_proj) is not nn.Linear  # oneDNN's, as before
