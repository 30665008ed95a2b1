"""Float models whose widths are not whole blocks of 32 take the fused CPU step (issue 49 §2).

The float kernels, the norms and attention of cpu_decode.c sum over the true width (8-lane loops, then scalar
tails, one order per row), so a hidden width of 48 and an MLP width of 80 (head_dim 12: not a multiple of 8
either) need no padding: the engine sends such a float model to the C step (blocker None) instead of torch's
GEMMs, whose answers move with the batch. (int8 and fp8 weights at these widths: test_cpu_decode_oddquant.py.)
"""
from __future__ import annotations

import pytest
import torch
from test_cpu_decode import LENS, TABLES, assert_rows_alone_equal_batched, decode_step, random_model, tiny_config
from test_cpu_decode_invariance import _invariant_prompt_rows, _torch_prompt_rows, assert_half_step_equals_float32_step

from kaon_runtime.kernels import cpu_decode
from kaon_runtime.models.cpu_decode_step import blocker

pytestmark = pytest.mark.skipif(cpu_decode.compiler() is None, reason=cpu_decode.NO_COMPILER)

ODD = dict(hidden_size=48, intermediate_size=80, head_dim=12)  # 4 heads x 12 = 48: attention's width odd too


def test_odd_widths_take_the_step_with_float_weights():
    """(int8 and fp8 too, int4 not: test_cpu_decode_oddquant.py)"""
    assert blocker(tiny_config(**ODD)) is None
    assert blocker(tiny_config(head_dim=20)) is None  # o's input alone odd (4 heads x 20 = 80)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
# qkv/gate_up, down, fused q|k|v; 44: not a multiple of 8 either (the scalar tail after the 8-lane loop)
@pytest.mark.parametrize(("n", "k"), [(80, 48), (48, 80), (144, 48), (36, 44)])
def test_odd_width_projections_match_torch_and_a_row_is_the_same_alone(dtype, n, k):
    torch.manual_seed(11)
    w, b, x = torch.randn(n, k).to(dtype), torch.randn(n), torch.randn(5, k)
    weights = cpu_decode.LinearWeights.f32(w, b)
    torch.testing.assert_close(cpu_decode.linear(weights, x), torch.nn.functional.linear(x, w.float(), b),
                               atol=1e-4, rtol=1e-5)
    assert_rows_alone_equal_batched(weights, x)
    head_t = torch.randn(k, 100).to(dtype)  # the vocabulary head [K, N]: strips of 16 and a tail
    assert_rows_alone_equal_batched(cpu_decode.LinearWeights.f32_t(head_t), x)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_an_odd_width_decode_step_matches_the_torch_path(kv_dtype):
    config = tiny_config(attention_bias=True, **ODD)
    model, cache = random_model(config, blocks=10, kv_dtype=kv_dtype)
    x, positions, meta = decode_step(config, TABLES, LENS)
    model.check_kernels()
    with torch.inference_mode():
        step = model.model.cpu_decode
        assert step is not None and step.applies(x, meta), "the C step runs it"
        model.model.cpu_decode = None
        expected, expected_cache = model.model(x.clone(), positions, meta), cache.clone()
        model.model.cpu_decode = step
        meta.decode_key_mask = None
        out = model.model(x.clone(), positions, meta)
    close = dict(atol=1e-4, rtol=1e-4) if kv_dtype == torch.float32 else dict(atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(out, expected, **close)
    torch.testing.assert_close(cache[0], expected_cache[0], **close)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_an_odd_width_prompts_rows_are_invariant_and_torchs(kv_dtype, monkeypatch):
    """The same bits chunked, after a cached prefix, beside decodes and in pieces; torch's prefill to float32
    rounding (a float32 cache)."""
    monkeypatch.delenv("KAON_CPU_PREFILL", raising=False)
    config = tiny_config(attention_bias=True, **ODD)
    whole = _invariant_prompt_rows(config, kv_dtype, None)
    if kv_dtype == torch.float32:
        model, _ = random_model(config, blocks=10, cpu_decode=False)
        torch.testing.assert_close(whole, _torch_prompt_rows(model, config), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_an_odd_width_half_model_step_equals_the_float32_step_on_the_same_values(dtype):
    """A float16 / bfloat16 model at these widths: the float32 model's step on the same (rounded) weights, bit
    for bit, and the same keys and values stored (as test_cpu_decode_invariance's check at whole blocks)."""
    assert_half_step_equals_float32_step(tiny_config(attention_bias=True, **ODD), dtype)
