"""cpu_decode.c builds wherever there is a C compiler, and its paths chosen by CPU flags agree.

A compile error must fail here, with the compiler's message: the engine quietly falls back to
torch (cpu_decode.library() returns None), and the fused step's ~90 tests skip only where there
is no compiler at all.

-march=native picks the paths by what the CPU has (AVX2 and FMA, VNNI or not, AVX-512 for the
compiler's own choices). The vector paths promise the same bits (cpu_decode.c: VNNI's and
maddubs' integer sums are exact, the float sums run in the same order), so the AVX2-only build
(x86-64-v3, no VNNI) must equal the native one bit for bit; the scalar build (x86-64-v2) sums in
another order and is held to the torch tolerances of test_cpu_decode.py. This machine runs each
build it can: so an Intel CI machine checks the paths an AMD one takes, and the other way round.
"""
from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest
import test_cpu_decode_lora as lora
import torch
from test_cpu_decode import (
    LENS,
    TABLES,
    assert_same_cache,
    decode_step,
    random_model,
    tiny_config,
)
from test_cpu_decode_fp8_block import quantize_fp8_blocks

from kaon_runtime.kernels import cpu_decode
from kaon_runtime.quant.fp8 import quantize_fp8
from kaon_runtime.quant.int4 import quantize_int4
from kaon_runtime.quant.int8 import quantize_int8


def test_it_builds_wherever_there_is_a_compiler():
    compiler = cpu_decode.compiler()
    if compiler is None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must test the fused CPU step: {cpu_decode.NO_COMPILER}")
        pytest.skip(cpu_decode.NO_COMPILER)
    cpu_decode.build(compiler)  # raises with the compiler's message
    assert cpu_decode.library() is not None, "built, yet library() is None: KAON_CPU_DECODE=off?"


# x86-64 levels: v3 is AVX2, FMA and F16C (the vector paths, without VNNI); v3 with AVX-VNNI takes
# the 256-bit VNNI dot products (Intel's client cores; native here may be AVX-512's, whose two activation
# passes run side by side in 512-bit registers); v2 has none of them. avx512-no-amx: this CPU without its
# AMX tiles, as Zen 4 runs (the pair kernels at every row count, where native Intel takes AMX from 4 rows).
AVX2 = {"avx2", "fma", "f16c", "bmi2", "movbe"}
LEVELS = {"avx2": ("-march=x86-64-v3", AVX2), "avx2-vnni": ("-march=x86-64-v3 -mavxvnni", AVX2 | {"avx_vnni"}),
          "avx512-no-amx": ("-march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
                            {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_int8"}),
          "scalar": ("-march=x86-64-v2", set())}


def _cpu_flags() -> set[str]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return {flag for line in lines if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


@pytest.fixture(params=sorted(LEVELS))
def level_library(request, monkeypatch):
    """(the level's name, the native library, the level's library): `cpu_decode.library()` returns
    the level's while the test runs, so the model's fused step runs on it."""
    march, needs = LEVELS[request.param]
    compiler = cpu_decode.compiler()
    if compiler is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the levels are x86-64's; this machine has no compiler or another CPU")
    if not needs <= _cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(needs - _cpu_flags())}: it cannot run the {request.param} build")
    native = cpu_decode.library()
    assert native is not None
    flags = [f for flag in cpu_decode.FLAGS for f in (march.split() if flag == "-march=native" else [flag])]
    level = cpu_decode.load(cpu_decode.build(compiler, flags))
    monkeypatch.setattr(cpu_decode, "library", lambda: level)
    return request.param, native, level


def _projections() -> list[tuple[cpu_decode.LinearWeights, torch.Tensor]]:
    """One weight of each kind the narrow and float paths read, and rows of activations for it."""
    torch.manual_seed(11)
    w = torch.randn(84, 128)
    x = torch.randn(5, 128) * torch.logspace(-2, 1, 128)
    w4 = quantize_int4(w, 32)
    values = torch.randint(0, 64, (84, 128), dtype=torch.uint8)
    scales32, mins32 = torch.rand(84, 4) / 10, torch.randn(84, 4) / 10  # per 32 values (q5)
    return [(cpu_decode.LinearWeights.f32(w, torch.randn(84)), x),
            (cpu_decode.LinearWeights.f32_t(w.T.contiguous()), x),
            (cpu_decode.LinearWeights.int8(*quantize_int8(w)), x),
            (cpu_decode.LinearWeights.q4_1(w4.packed, w4.scales, w4.mins), x),
            (cpu_decode.LinearWeights.q4_f32(w4.packed, w4.scales.float(), w4.mins.float()), x),
            (cpu_decode.LinearWeights.q8_g16(quantize_int8(w)[0], torch.rand(84, 8) / 10, torch.randn(84, 8) / 10), x),
            (cpu_decode.LinearWeights.q5(values >> 1, scales32.half(), mins32.half()), x),
            (cpu_decode.LinearWeights.q5(values >> 1, scales32, mins32), x),
            (cpu_decode.LinearWeights.q6_g16(values, torch.rand(84, 8) / 10), x),
            *((cpu_decode.LinearWeights.f32(w.to(half), torch.randn(84)), x) for half in HALVES),
            *((cpu_decode.LinearWeights.f32_t(w.T.contiguous().to(half)), x) for half in HALVES),
            *((cpu_decode.LinearWeights.fp8(*quantize_fp8(w), torch.randn(84), fp8_inputs), x)  # fp8: widened
              for fp8_inputs in (False, True)),
            (cpu_decode.LinearWeights.int8_a8(*quantize_int8(w), torch.randn(84)), x),  # W8A8 int8: exact sums
            (cpu_decode.LinearWeights.int8_s8(*quantize_int8(w), 0.02, 3.0, torch.randn(84)), x),  # static int8 grid
            (cpu_decode.LinearWeights.fp8(*quantize_fp8(w), torch.randn(84), input_scale=0.01), x),  # static inputs
            (cpu_decode.LinearWeights.fp8_block(*quantize_fp8_blocks(w, (16, 48)), (16, 48), torch.randn(84)), x),
            (cpu_decode.LinearWeights.fp8_block(*quantize_fp8_blocks(w, (16, 48)), (16, 48), torch.randn(84),
                                                input_scale=0.01), x)]  # block FP8 with static inputs


HALVES = (torch.float16, torch.bfloat16)  # float weights read as stored, widened in registers


def _linear(lib, weights: cpu_decode.LinearWeights, x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], weights.struct.n)
    work = torch.empty(lib.kaon_linear_workspace(weights.struct.k, x.shape[0]), dtype=torch.uint8)
    lib.kaon_linear(cpu_decode.ctypes.byref(weights.struct), x.shape[0], x.data_ptr(), out.data_ptr(),
                    work.data_ptr(), 1)
    return out


@pytest.mark.parametrize("activations", ["int8", "int8x2"])  # KAON_CPU_ACTIVATIONS: one int8 pass or two
def test_every_projection_kind_agrees_across_the_flag_paths(level_library, activations, monkeypatch):
    monkeypatch.setenv("KAON_CPU_ACTIVATIONS", activations)
    name, native, level = level_library
    # one row too: batch 1, whose two passes native AVX-512 takes in half registers
    for weights, x in [(w, x) for w, rows in _projections() for x in (rows, rows[:1])]:
        ours, theirs = _linear(level, weights, x), _linear(native, weights, x)
        if name != "scalar":
            assert torch.equal(ours, theirs), (f"kind {weights.struct.kind}, {x.shape[0]} rows: the {name} path's "
                                               f"bits differ from native's")
        else:  # the scalar sums in another order: as close as the kernels' tests hold them to their references
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [20, 96])  # the attention's tail path, and its 64-wide one
def test_a_decode_step_agrees_across_the_flag_paths(level_library, head_dim, kv_dtype):
    name, native, _level = level_library
    config = tiny_config(attention_bias=True, head_dim=head_dim)
    results = {}
    for which in ("level", "native"):
        model, cache = random_model(config, blocks=10, kv_dtype=kv_dtype)
        x, positions, meta = decode_step(config, TABLES, LENS)
        model.check_kernels()
        meta.decode_key_mask = None
        with torch.inference_mode():
            if which == "native":
                with pytest.MonkeyPatch.context() as patch:
                    patch.setattr(cpu_decode, "library", lambda: native)
                    results[which] = model.model(x.clone(), positions, meta), cache
            else:
                results[which] = model.model(x.clone(), positions, meta), cache
    (out, cache), (expected, expected_cache) = results["level"], results["native"]
    if name != "scalar":
        assert torch.equal(out, expected) and torch.equal(cache, expected_cache)
    else:
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
        assert_same_cache(cache, expected_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_decode_step_with_adapters_agrees_across_the_flag_paths(level_library, dtype):
    """Rows of three adapters and the base, the slots in the model's dtype (half ones widened as they are read)."""
    name, native, _level = level_library
    results = {}
    for which in ("level", "native"):
        model, cache, batch, _ = lora.model_with_adapters(None, dtype)
        x, positions, meta = lora.decode_step()
        model.check_kernels()
        with torch.inference_mode(), pytest.MonkeyPatch.context() as patch:
            if which == "native":
                patch.setattr(cpu_decode, "library", lambda: native)
            batch.set(lora.ROW_SLOTS, x.device)
            results[which] = model.model(x.to(dtype), positions, meta), cache
    (out, cache), (expected, expected_cache) = results["level"], results["native"]
    if name != "scalar":
        assert torch.equal(out, expected) and torch.equal(cache, expected_cache)
    else:  # another summation order: a half output may round one step of its dtype apart
        tolerance = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
        torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(cache, expected_cache, atol=1e-4, rtol=1e-4)
