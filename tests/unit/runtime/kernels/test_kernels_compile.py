"""Every Triton kernel compiles for Hopper (sm_90a), as launched, without spilling registers.

The interpreter runs kernels as Python and cannot tell whether the GPU compiler accepts
them. Triton compiles ahead of time without a GPU, though, with the ptxas it ships. So the
launchers run here on model-sized shapes (bf16 and fp32) with each launch's argument types
and constexprs recorded in place of the launch; a subprocess without the
interpreter then compiles each distinct launch for sm_90a, and ptxas reports registers
and spills. A spill means local-memory traffic in a kernel whose point is memory speed.
bf16 and fp16, the dtypes a GPU serves in, must not spill; float32 (exact products on the
CUDA cores, for checks rather than speed) only has to compile.
"""
from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kaon_runtime.kernels import (
    activation,
    invariant_gemm,
    kv_cache,
    moe,
    norm,
    paged_attention,
    quant_gemm,
    quant_gemv,
    rotary,
)
from kaon_runtime.layers.rotary import RotaryEmbedding
from kaon_runtime.quant.fp8 import quantize_fp8
from kaon_runtime.quant.int4 import quantize_int4
from kaon_runtime.quant.int8 import quantize_int8

pytestmark = pytest.mark.slow  # every Triton kernel compiled for sm_90a (make unit leaves it out)

triton = pytest.importorskip("triton")
if __name__ != "__main__" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("records launches through the interpreter (a GPU runs the kernels themselves)", allow_module_level=True)

MODULES = (activation, invariant_gemm, kv_cache, moe, norm, paged_attention, quant_gemm, quant_gemv, rotary)


def _launches(dtype: torch.dtype) -> None:
    """Each launcher once per path, on Llama-3.1-8B-like widths (few rows, so the interpreter is quick)."""
    torch.manual_seed(0)
    heads, kv_heads, dim, block, hidden = 32, 8, 128, 16, 4096
    x = torch.randn(2, hidden).to(dtype)
    weight = torch.ones(hidden, dtype=dtype)
    norm.rms_norm(x, weight, 1e-5)
    norm.rms_norm(x, weight, 1e-5, residual=x.clone())
    activation.silu_and_mul(torch.randn(2, 2 * 1792).to(dtype))
    cos, sin = RotaryEmbedding(dim, 4096, 500000.0).lookup(torch.tensor([3, 70]), torch.device("cpu"))
    rotary.apply_rotary(torch.randn(2, heads + kv_heads, dim).to(dtype), cos, sin)
    k_cache = torch.randn(kv_heads, 8, block, dim).to(dtype)
    v_cache = torch.randn(kv_heads, 8, block, dim).to(dtype)
    new = torch.randn(2, kv_heads, dim).to(dtype)
    kv_cache.write_kv_cache(new, new, k_cache, v_cache, torch.tensor([5, -1]))
    qkv = torch.randn(2, heads + 2 * kv_heads, dim).to(dtype)  # the decode step's fused rotary + cache write
    rotary.rotary_write_kv(qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:], cos, sin,
                           k_cache, v_cache, torch.tensor([5, -1]))
    if dtype == torch.bfloat16:  # partial rotary (Phi-3's variants): the pass-through tail
        half_cos, half_sin = (t[..., :dim // 4].contiguous() for t in (cos, sin))
        rotary.rotary_write_kv(qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:],
                               half_cos, half_sin, k_cache, v_cache, torch.tensor([5, -1]), dim // 2)
    tables, lens = torch.tensor([[0, 1, 2, 3]]), torch.tensor([50])
    q = torch.randn(1, heads, dim).to(dtype)
    for partition in (None, 16):  # whole context, and split into partitions then merged
        paged_attention.decode_attention(q, k_cache, v_cache, tables, lens, dim ** -0.5, torch.empty_like(q),
                                         partition_size=partition)
    chunk = torch.randn(20, heads, dim).to(dtype)
    paged_attention.prefill_attention(chunk, k_cache, v_cache, tables, torch.tensor([0]), torch.tensor([20]),
                                      torch.tensor([50]), 20, dim ** -0.5, torch.empty_like(chunk))
    # KAON_GPU_BATCH_INVARIANT's variants: key tiles aligned under a window, Gemma's offset norm over a
    # strided head view (Qwen3's q/k norms).
    paged_attention.prefill_attention(chunk, k_cache, v_cache, tables, torch.tensor([0]), torch.tensor([20]),
                                      torch.tensor([50]), 20, dim ** -0.5, torch.empty_like(chunk), window=8,
                                      invariant=True)
    norm.rms_norm(qkv[:, :heads], torch.ones(dim, dtype=dtype), 1e-5, weight_offset=1.0)
    experts, width, moe_hidden = 4, 64, 128  # Mixtral's layout, small: the fused experts, slots summed in order
    moe.fused_moe(torch.randn(2, moe_hidden).to(dtype), torch.randn(experts, 2 * width, moe_hidden).to(dtype),
                  torch.randn(experts, moe_hidden, width).to(dtype), torch.full((2, 2), 0.5),
                  torch.tensor([[0, 1], [2, 3]]), invariant=True)
    # The batch-invariant GEMMs (KAON_GPU_BATCH_INVARIANT=1) at their own tiles: K split into ranges and the
    # ranges' sum (N = 256, K = 4096), and one range (K = 128); FP8 and the quantized formats' fixed tiles too.
    invariant_gemm.linear(x[:, :128], torch.randn(256, 128).to(dtype))
    invariant_gemm.linear(x, torch.randn(256, hidden).to(dtype), torch.ones(256).to(dtype))
    if dtype == torch.bfloat16:
        fp8_long = quantize_fp8(torch.randn(256, hidden))[0]
        invariant_gemm.fp8_linear(x, fp8_long, torch.rand(256))
        invariant_gemm.fp8_block_linear(x, fp8_long, torch.rand(2, hidden // 128), (128, 128))
        invariant_gemm.w8a16_linear(x, *quantize_int8(torch.randn(64, hidden)))
        w4_long = quantize_int4(torch.randn(64, hidden))
        invariant_gemm.w4a16_linear(x, w4_long.packed, w4_long.scales, w4_long.mins, w4_long.group_size)
    if dtype == torch.float16:
        return
    w = torch.randn(64, 512)
    qweight, scales = quantize_int8(w)
    w4 = quantize_int4(w)
    for rows, split in ((1, 4), (1, None), (33, None)):  # decode split over K, decode, prefill tiles
        a = torch.randn(rows, 512).to(dtype)
        quant_gemm.w8a16_matmul(a, qweight, scales, split_k=split)
        quant_gemm.w4a16_matmul(a, w4.packed, w4.scales, w4.mins, w4.group_size, split_k=split)
    # Decode's matrix-vector kernels with the default tiles: each format at one row, int4 at several too
    # (one accumulator per row); float32 only the int4 kernel (a GPU serves quantized models in bf16).
    a = torch.randn(1, 512).to(dtype)
    quant_gemv.w4a16_gemv(torch.randn(3, 512).to(dtype), w4.packed, w4.scales, w4.mins, w4.group_size)
    quant_gemv.w4a16_gemv(a, w4.packed, w4.scales, w4.mins, w4.group_size)
    if dtype == torch.bfloat16:
        fp8, fp8_scales = quantize_fp8(w)
        quant_gemv.w8a16_gemv(a, qweight, scales)
        quant_gemv.fp8_gemv(a, fp8, fp8_scales)
        quant_gemv.fp8_block_gemv(a, fp8, torch.ones(1, 4), (128, 128))
        # The GPU sweep's other tile options (bench/gpu/gemv_sweep.py), each at least once, so a variant
        # the compiler refuses or that spills fails here rather than costing a lease's sweep.
        defaults = dict(quant_gemv.TILES)
        try:
            for tile in (quant_gemv.Tile(8, 128, rows_inner=True, x_once=True, fold=True),
                         quant_gemv.Tile(8, 128, rows_inner=True, x_once=True, fold=True, prefetch=True),
                         quant_gemv.Tile(8, 128, rows_inner=True, fold=True),
                         quant_gemv.Tile(8, 64, rows_inner=True, vec=16, x_once=True, fold=True)):
                quant_gemv.configure({"int4": tile, "fp8": tile, "fp8_block": tile})
                quant_gemv.w4a16_gemv(torch.randn(2, 512).to(dtype), w4.packed, w4.scales, w4.mins, w4.group_size)
                quant_gemv.fp8_gemv(a, fp8, fp8_scales)
                quant_gemv.fp8_block_gemv(a, fp8, torch.ones(1, 4), (128, 128))
        finally:
            quant_gemv.configure(defaults)


def _signature(kernel, args: tuple, kwargs: dict) -> dict:
    """The launch as the JIT specializes it (Triton's own rule: ints equal to 1 become constants,
    pointers and ints divisible by 16 are marked so, which lets loads vectorize), plus compile options."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    params = inspect.signature(kernel.fn).parameters
    values = dict(zip(kernel.arg_names, args)) | {k: v for k, v in kwargs.items() if k in params}
    signature, constexprs, divisible = {}, {}, []
    for index, name in enumerate(kernel.arg_names):
        value = values[name]
        if "constexpr" in str(params[name].annotation):
            signature[name], constexprs[name] = "constexpr", value
            continue
        kind, key = native_specialize_impl(BaseBackend, value, False, True, True)
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = key
        elif key == "D":
            divisible.append(index)
    options = {k: v for k, v in kwargs.items() if k not in params}
    return {"module": kernel.fn.__module__, "kernel": kernel.fn.__name__, "signature": signature,
            "constexprs": constexprs, "divisible": divisible, "options": options}


@pytest.fixture(scope="module")
def recorded_launches():
    return record_launches()


def record_launches() -> list[dict]:
    """Run the launchers with every kernel's launches recorded, not run.

    A launch's specialization depends on its arguments' types, ints and pointer alignment, never on what a
    tensor holds, so the kernels themselves are not run: interpreted at these widths they cost ~45 CPU s,
    and the recorded launches are the same (109, checked 2026-12-01). The kernels' results are tested
    against their references in test_kernels.py, test_paged_attention.py and the quant tests."""
    specs, dtype = {}, None
    kernels = [k for m in MODULES for k in vars(m).values() if hasattr(k, "arg_names") and hasattr(k, "run")]
    originals = {}
    for kernel in kernels:
        def run(*args, grid, warmup, _kernel=kernel, **kwargs):
            spec = _signature(_kernel, args, kwargs) | {"activations": str(dtype)}
            specs[json.dumps(spec, sort_keys=True)] = spec
        originals[kernel] = kernel.run
        kernel.run = run
    try:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            _launches(dtype)  # the hook above reads `dtype` as it is at each launch
    finally:
        for kernel, original in originals.items():
            kernel.run = original
    # The matrix-vector kernels widen bytes with inline PTX on a GPU only (the interpreter runs the plain
    # path): compile that path too, so a PTX the assembler refuses fails here rather than on a lease.
    on_gpu = [spec | {"constexprs": spec["constexprs"] | {"ASM": True}} for spec in specs.values()
              if spec["kernel"] == "_gemv_kernel" and spec["activations"] == str(torch.bfloat16)]
    # The invariant GEMM widens bfloat16 operands to float32 in the interpreter only (DOT_F32, whose tl.dot
    # multiplies bfloat16 as integers): compile the launch a GPU makes, the bfloat16 tensor-core dot.
    as_on_gpu = [spec | {"constexprs": spec["constexprs"] | {"DOT_F32": False}} if spec["constexprs"].get("DOT_F32")
                 else spec for spec in specs.values()]
    return as_on_gpu + on_gpu


def compile_for_hopper(specs: list[dict], tmp_path: Path) -> list[dict]:
    """Each launch compiled in a subprocess without the interpreter: registers and spills per launch."""
    (tmp_path / "specs.json").write_text(json.dumps(specs))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, __file__, str(tmp_path / "specs.json")], env=env, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_every_kernel_compiles_for_hopper_without_spilling(recorded_launches, tmp_path):
    launched = {s["kernel"] for s in recorded_launches}
    # Launched jit functions are named *_kernel; the others (_attend, _store) are device functions.
    defined = {name for m in MODULES for name, k in vars(m).items()
               if hasattr(k, "arg_names") and name.endswith("_kernel")}
    assert launched == defined, f"kernels never launched here: {defined - launched}"
    report = compile_for_hopper(recorded_launches, tmp_path)
    assert len(report) == len(recorded_launches)
    spilling = [r for r in report if (r["spill_stores"] or r["spill_loads"]) and r["activations"] != "torch.float32"]
    assert not spilling, spilling
    assert all(0 < r["registers"] <= 255 for r in report)


# ---- the subprocess: compile each launch for sm_90a, ask ptxas for its resource use ------------

def _compile_all(specs_path: str) -> None:
    import importlib
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource
    ptxas = get_ptxas(90).path  # the ptxas Triton itself uses for Hopper
    report = []
    for spec in json.loads(Path(specs_path).read_text()):
        fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
        attrs = {(index,): [["tt.divisibility", 16]] for index in spec["divisible"]}
        source = ASTSource(fn=fn, signature=spec["signature"], constexprs=spec["constexprs"], attrs=attrs)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=spec["options"])
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
            ptx.write(compiled.asm["ptx"])
            ptx.flush()
            info = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx.name, "-o", os.devnull],
                                  capture_output=True, text=True, check=True).stderr
        if os.environ.get("KAON_PTXAS_LOG"):
            print(spec["kernel"], spec["constexprs"], info, file=sys.stderr)
        # The kernel may call non-inlined functions, each reported apart: take the worst of each figure.
        numbers = {key: max(int(n) for n in re.findall(rf"(\d+) {pattern}", info)) for key, pattern in
                   (("registers", "registers"), ("spill_stores", "bytes spill stores"),
                    ("spill_loads", "bytes spill loads"))}
        report.append({"kernel": spec["kernel"], "constexprs": spec["constexprs"], "activations": spec["activations"],
                       "dtypes": sorted({t for t in spec["signature"].values() if t.startswith("*")}), **numbers})
    print(json.dumps(report))


if __name__ == "__main__":
    _compile_all(sys.argv[1])
