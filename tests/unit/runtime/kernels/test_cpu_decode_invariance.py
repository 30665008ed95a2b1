"""Batch invariance of the fused CPU step, and its float16 / bfloat16 weights (issue 49, sections 2 and 5).

A prompt's tokens through the C step get the same bits whether the prompt is prefilled in one
step, in chunks, beside other sequences' decodes, or in pieces of a few rows (models/cpu_decode_step.py):
each row is computed alone. float16 and bfloat16 weights are widened to float32 as they are
loaded, so their kernels equal the float32 kernel on the widened weights bit for bit
(cpu_decode.c), and that kernel is tested against torch (test_cpu_decode.py).
"""
from __future__ import annotations

import pytest
import torch
from test_cpu_decode import BLOCK, LENS, TABLES, WINDOWS, decode_step, random_model, tiny_config

from kaon_runtime.kernels import cpu_decode
from kaon_runtime.kernels.quant_gemm_ref import pack_int4, quantize_activations_ref
from kaon_runtime.layers.attention import AttentionMetadata, PrefillChunk
from kaon_runtime.models.cpu_decode_step import blocker
from kaon_runtime.quant import quantize_model
from kaon_runtime.quant.int4 import quantize_int4
from kaon_runtime.quant.int8 import quantize_int8

pytestmark = pytest.mark.skipif(cpu_decode.compiler() is None, reason=cpu_decode.NO_COMPILER)

HALVES = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("rows", [1, 5])
def test_half_weights_equal_the_float32_kernel_on_their_widened_values(dtype, rows):
    torch.manual_seed(0)
    w, b, x = torch.randn(84, 104).to(dtype), torch.randn(84), torch.randn(rows, 104)  # 104: the 8-wide tail
    out = cpu_decode.linear(cpu_decode.LinearWeights.f32(w, b), x)
    assert torch.equal(out, cpu_decode.linear(cpu_decode.LinearWeights.f32(w.float(), b), x))
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w.float(), b), atol=1e-4, rtol=1e-5)
    head_t = torch.randn(300, 1000).to(dtype)  # the vocabulary head's [K, N] layout: strips and a tail
    x_head = torch.randn(rows, 300)
    out = cpu_decode.linear(cpu_decode.LinearWeights.f32_t(head_t), x_head)
    assert torch.equal(out, cpu_decode.linear(cpu_decode.LinearWeights.f32_t(head_t.float()), x_head))
    torch.testing.assert_close(out, x_head @ head_t.float(), atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("method", [None, "int8", "int4"])
@pytest.mark.parametrize("dtype", HALVES)
def test_a_half_model_step_equals_the_float32_step_on_the_same_values(dtype, method):
    """The whole decode step of a float16 / bfloat16 model is the float32 model's on the same
    (rounded) weights, bit for bit, both with a cache of that dtype; the keys and values it stores
    are the float32 ones rounded to nearest, as torch's .to() rounds. With int8 / int4 projections
    (--dtype bfloat16 --quantization int4, issue 49 §2) too: the narrow kernels and their activation
    pass are the float32 model's, only the norms, biases and cache are read from the half dtype."""
    assert_half_step_equals_float32_step(tiny_config(attention_bias=True), dtype, method)


def assert_half_step_equals_float32_step(config, dtype, method: str | None = None) -> None:
    """A `dtype` model's whole decode step (projections quantized by `method`, or float) is the float32 model's on
    the same rounded weights, bit for bit, and it stores the same keys and values."""
    results = []
    for model_dtype in (torch.float32, dtype):
        model, cache = random_model(config, blocks=10, kv_dtype=dtype)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(dtype))  # the same values in both models
        model = model.to(model_dtype)
        if method:
            quantize_model(model, method)  # (both quantizers read the weights as float32: the same blocks)
        x, positions, meta = decode_step(config, TABLES, LENS)
        model.check_kernels()
        assert model.model.cpu_decode is not None, "the C step runs it"
        with torch.inference_mode():
            out = model.model(x.to(dtype).to(model_dtype), positions, meta)  # the same inputs
        results.append((out, cache))
    (full, full_cache), (half, half_cache) = results
    assert half.dtype == dtype
    assert torch.equal(half, full.to(dtype)) and torch.equal(half_cache, full_cache)


def _prompt_rows(config, kv_dtype, steps, neighbours: bool = False, max_rows: int | None = None,
                 method: str | None = None):
    """A 7-token prompt (blocks 1 and 4) prefilled in `steps` (token ranges), optionally beside the
    three decodes of TABLES, its projections quantized by `method` (int8, int4) or float; returns its
    rows' outputs, in order."""
    model, _ = random_model(config, blocks=10, kv_dtype=kv_dtype)
    if method:
        quantize_model(model, method)
    model.check_kernels()
    assert model.model.cpu_decode.prefills, "the prompt's rows go through the C step"
    step = model.model.cpu_decode
    if max_rows:
        step.max_rows = step.piece_rows = max_rows
    torch.manual_seed(9)
    prompt, table = torch.randn(7, config.hidden_size), torch.tensor([1, 4])
    slots = torch.tensor([table[i // BLOCK] * BLOCK + i % BLOCK for i in range(7)])
    outs = []
    for start, end in steps:
        chunk = PrefillChunk(query_start=0, query_len=end - start, context_len=end, block_table=table)
        x, positions = prompt[start:end], torch.arange(start, end)
        meta = AttentionMetadata(slot_mapping=slots[start:end], prefills=[chunk])
        if neighbours:
            dx, dpos, dmeta = decode_step(config, TABLES, LENS)
            chunk.query_start = dx.shape[0]
            meta = AttentionMetadata(slot_mapping=torch.cat([dmeta.slot_mapping, meta.slot_mapping]),
                                     num_decode_tokens=dx.shape[0], decode_block_tables=dmeta.decode_block_tables,
                                     decode_context_lens=dmeta.decode_context_lens, prefills=[chunk])
            x, positions = torch.cat([dx, x]), torch.cat([dpos, positions])
        with torch.inference_mode():
            out = model.model(x.clone(), positions, meta)
        outs.append(out[-(end - start):])
    return torch.cat(outs)


@pytest.mark.parametrize(("kv_dtype", "method", "activations", "window"), [
    (torch.float32, None, None, None), (torch.float16, None, None, None),
    (torch.float32, "int8", None, None), (torch.float16, "int4", None, None),  # the default: one int8 pass per block
    (torch.float32, "int8", "int8x2", None), (torch.float16, "int4", "int8x2", None),
    (torch.float32, None, None, 3), (torch.float16, "int4", None, 3)])  # sliding windows shorter than the prompt
def test_a_prompts_rows_do_not_depend_on_chunking_neighbours_or_pieces(kv_dtype, method, activations, window,
                                                                        monkeypatch):
    # Nothing set but the activation passes: every precision's prompt rows take the C step by default
    monkeypatch.delenv("KAON_CPU_PREFILL", raising=False)
    if activations:
        monkeypatch.setenv("KAON_CPU_ACTIVATIONS", activations)
    else:
        monkeypatch.delenv("KAON_CPU_ACTIVATIONS", raising=False)
    config = tiny_config(attention_bias=True, sliding_window=window)
    _invariant_prompt_rows(config, kv_dtype, method)


def _invariant_prompt_rows(config, kv_dtype, method) -> torch.Tensor:
    """The prompt's 7 rows through the C step, asserted the same bits chunked, after a cached prefix, beside
    decodes and in pieces."""
    whole = _prompt_rows(config, kv_dtype, [(0, 7)], method=method)
    assert torch.equal(_prompt_rows(config, kv_dtype, [(0, 3), (3, 7)], method=method), whole), "chunked prefill"
    assert torch.equal(_prompt_rows(config, kv_dtype, [(0, 5), (5, 6), (6, 7)], method=method), whole), \
        "a cached prefix"
    assert torch.equal(_prompt_rows(config, kv_dtype, [(0, 4), (4, 7)], neighbours=True, method=method), whole), \
        "neighbours"
    assert torch.equal(_prompt_rows(config, kv_dtype, [(0, 7)], neighbours=True, max_rows=3, method=method),
                       whole), "pieces"
    return whole


def assert_fp8_prompt_rows_invariant(convert, kv_dtype, monkeypatch) -> None:
    """The fp8 files' prompt-row check: the engine sends fp8 models (weights made by `convert(model)`) to the C
    step (blocker None), whose prompt rows are the same bits chunked, after a cached prefix, beside decodes and in
    pieces; and, on a float32 cache, torch's prefill to float32 rounding."""
    monkeypatch.delenv("KAON_CPU_PREFILL", raising=False)
    assert blocker(tiny_config(), quantization="fp8") is None
    monkeypatch.setitem(globals(), "quantize_model", lambda model, _: convert(model))
    config = tiny_config(attention_bias=True)
    whole = _invariant_prompt_rows(config, kv_dtype, "fp8")
    if kv_dtype == torch.float32:
        model, _ = random_model(config, blocks=10, cpu_decode=False)
        convert(model)
        torch.testing.assert_close(whole, _torch_prompt_rows(model, config), atol=1e-4, rtol=1e-4)


def _torch_prompt_rows(model, config) -> torch.Tensor:
    """Torch's prefill of the 7 prompt rows _prompt_rows feeds the C step (same seed, blocks 1 and 4)."""
    torch.manual_seed(9)
    prompt = torch.randn(7, config.hidden_size)
    slots = torch.tensor([[1, 4][i // BLOCK] * BLOCK + i % BLOCK for i in range(7)])
    chunk = PrefillChunk(query_start=0, query_len=7, context_len=7, block_table=torch.tensor([1, 4]))
    with torch.inference_mode():
        return model.model(prompt, torch.arange(7), AttentionMetadata(slot_mapping=slots, prefills=[chunk]))


def test_the_prefill_rows_match_the_torch_path():
    """The C step's prefill (each token a row over the cache up to itself) computes what torch's
    prefill attention does, to float32 rounding."""
    config = tiny_config(attention_bias=True)
    fused = _prompt_rows(config, torch.float32, [(0, 3), (3, 7)], neighbours=True)
    model, _ = random_model(config, blocks=10, cpu_decode=False)
    expected = _torch_prompt_rows(model, config)
    torch.testing.assert_close(fused, expected, atol=1e-4, rtol=1e-4)


OPTIONS = {"qk_norm": dict(qk_norm=True), "rotary_dim": dict(rotary_dim=12), "gemma": WINDOWS["gemma"],
           "gemma2": WINDOWS["gemma2"]}


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize(("kv_dtype", "method"), [(torch.float32, None), (torch.float16, "int4")])
def test_q_k_norms_partial_rotary_and_gemma_keep_a_prompts_rows_invariant_and_torchs(kv_dtype, method, option,
                                                                                     monkeypatch):
    """Qwen3's q/k norms (each q and k head normalised before rotary), partial rotary (Phi-3's variants: 12
    of each head's 16 dims), Gemma's offset norms and GeGLU, and Gemma 2's sandwich norms and soft-capped scores
    (with a 3-key window in the first layer) run in the C step (cpu_decode.c), so the engine sends such models
    there (blocker: None; it named "q/k norms", "partial rotary", "Gemma's norms", "the gelu_pytorch_tanh
    activation" and "attention soft-capping" before, and torch's prefill moved with chunking and neighbours):
    the prompt's rows get the same bits chunked, after a cached prefix, beside decodes and in pieces, and the
    float32 rows are torch's prefill's to float32 rounding."""
    monkeypatch.delenv("KAON_CPU_PREFILL", raising=False)
    monkeypatch.delenv("KAON_CPU_ACTIVATIONS", raising=False)
    config = tiny_config(**OPTIONS[option])
    assert blocker(config, quantization=method or "none") is None
    whole = _invariant_prompt_rows(config, kv_dtype, method)
    if method is None:
        model, _ = random_model(config, blocks=10, cpu_decode=False)
        torch.testing.assert_close(whole, _torch_prompt_rows(model, config), atol=1e-4, rtol=1e-4)


TOLERANCE = {"int8": 1e-4, "int8x2": 1e-3}  # a row's relative error against its reference, per KAON_CPU_ACTIVATIONS


@pytest.mark.parametrize("activations", sorted(TOLERANCE))
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_prefill_rows_compute_their_reference(method, activations, monkeypatch):
    """int8/int4 prompt rows through the C step (KAON_CPU_PREFILL=fused; the default for float weights) compute what
    the dequantizing torch path computes when fed the activations the kernels see (int8 blocks of 32,
    quantize_activations_ref), row for row: 7 rows (more than one tile of 4 rows of the narrow
    kernels), in two chunks beside three decodes. Scales, mins or activation blocks read from another
    row or group, or a tile's rows mixed up, put a row off by far more than float32's rounding.
    Both activation settings: one int8 pass per block, and two (KAON_CPU_ACTIVATIONS=int8x2: the remainder's pass is
    a row of its own in the kernels' tiles, summed back into its row)."""
    monkeypatch.setenv("KAON_CPU_PREFILL", "fused")
    monkeypatch.setenv("KAON_CPU_ACTIVATIONS", activations)
    passes = cpu_decode.activation_passes()
    config = tiny_config(attention_bias=True)
    fused = _prompt_rows(config, torch.float32, [(0, 3), (3, 7)], neighbours=True, method=method)
    monkeypatch.setenv("KAON_QUANT_KERNEL", "torch")
    model, _ = random_model(config, blocks=10, cpu_decode=False)
    quantized = [model.get_submodule(name) for name in quantize_model(model, method)]
    for module in quantized:
        module.register_forward_pre_hook(lambda _, args: (quantize_activations_ref(args[0], passes=passes),))
    expected = _torch_prompt_rows(model, config)
    error = (fused - expected).norm(dim=1) / expected.norm(dim=1)
    # Two passes leave ~15 bits per block, within float32's rounding of the two paths' other ops:
    # 1.2-1.5e-4 from their reference here, 2-4e-4 from float32 activations, 0.04-0.09 from one
    # pass's reference (the second pass skipped), ~1 for a row that reads another row's scale.
    assert error.max() < TOLERANCE[activations], f"rows off their reference: {error.tolist()}"


TWO_PASS_KINDS = ["int8", "q4_1", "q4_f32", "q5", "q8_g16", "q8_g16 with mins"]


def _two_pass_weights(kind: str, n: int = 84, k: int = 160) -> cpu_decode.LinearWeights:
    """A weight of each kind whose two activation passes have their own paths (pairs, AMX tiles, half
    registers); 84 outputs: an odd group of eight."""
    torch.manual_seed(5)
    values = torch.randint(0, 32, (n, k), dtype=torch.uint8)
    scales, mins = torch.rand(n, k // 32) / 10, torch.randn(n, k // 32) / 10
    q8 = torch.randint(-128, 128, (n, k), dtype=torch.int8)  # Q8_G16: the int8 head's kind
    scales16, mins16 = torch.rand(n, k // 16) / 10, torch.randn(n, k // 16) / 10
    w4 = quantize_int4(torch.randn(n, k), 32)
    make = {"int8": lambda: cpu_decode.LinearWeights.int8(*quantize_int8(torch.randn(n, k)), torch.randn(n)),
            "q4_1": lambda: cpu_decode.LinearWeights.q4_1(w4.packed, w4.scales, w4.mins, torch.randn(n)),
            "q4_f32": lambda: cpu_decode.LinearWeights.q4_f32(pack_int4(values & 15, 32), scales, mins),
            "q5": lambda: cpu_decode.LinearWeights.q5(values, scales.half(), mins.half()),
            "q8_g16": lambda: cpu_decode.LinearWeights.q8_g16(q8, scales16, None, torch.randn(n)),
            "q8_g16 with mins": lambda: cpu_decode.LinearWeights.q8_g16(q8, scales16, mins16)}[kind]
    return make()


@pytest.mark.parametrize("kind", TWO_PASS_KINDS)
def test_the_amx_tiles_give_the_pair_kernels_bits(kind, monkeypatch):
    """Two activation passes of many rows take AMX tiles where the CPU has AMX-INT8 (cpu_decode.c, KAON_AMX),
    Q8_G16 (a quantized model's int8 vocabulary head) in half blocks; fewer rows take the 512-bit pair kernels
    (Q8_G16: the two-row kernels): the same bits, so a row's result does not depend on which path its step's
    row count picks. Row counts: below the tiles' minimum, a partial tile, a full one, one and a half, and
    past two spans of 64 quantized rows (amx_groups unpacks a slice's weights once per span) with a short last
    tile; 84 outputs: an odd group of eight, padded in the tile."""
    monkeypatch.setenv("KAON_CPU_ACTIVATIONS", "int8x2")
    lib = cpu_decode.library()
    if not cpu_decode.set_amx(lib, True):
        pytest.skip("no AMX-INT8 here (or the kernel refuses its tile state): the pair kernels run every row count")
    weights = _two_pass_weights(kind)
    k = weights.struct.k
    x = torch.randn(75, k) * torch.logspace(-2, 1, k)
    try:
        for rows in (3, 4, 7, 8, 20, 24, 75):
            cpu_decode.set_amx(lib, True)
            tiles = cpu_decode.linear(weights, x[:rows])
            cpu_decode.set_amx(lib, False)
            pairs = cpu_decode.linear(weights, x[:rows])
            assert torch.equal(tiles, pairs), f"{rows} rows"
            alone = cpu_decode.linear(weights, x[rows - 1:rows])[0]  # one row: batch 1's half-register kernels
            assert torch.equal(tiles[-1], alone), f"{rows} rows, the last alone"
    finally:
        cpu_decode.set_amx(lib, True)


@pytest.mark.parametrize("kind", TWO_PASS_KINDS)
def test_batch_one_half_registers_give_the_batch_kernels_bits(kind, monkeypatch):
    """One activation row's two passes (batch-1 decode) take the half-register kernels where the build has
    AVX-512 VNNI (cpu_decode.c, HalfRow: the passes in the two halves of a register, no lane permutes):
    the same bits as the pair kernels, and a row alone equals that row inside a batch (pairs, or AMX tiles
    from 4 rows where the CPU has them), so batch 1 and a batch give one answer. int8 also against the
    pure-torch reference (the activations as quantize_activations_ref's two passes, dequantized weights)."""
    monkeypatch.setenv("KAON_CPU_ACTIVATIONS", "int8x2")
    lib = cpu_decode.library()
    if not cpu_decode.set_halves(lib, True):
        pytest.skip("no AVX-512 VNNI here: batch 1 takes the 256-bit kernels (test_cpu_decode_build.py compares them)")
    torch.manual_seed(6)
    weights = _two_pass_weights(kind)
    k = weights.struct.k
    x = torch.randn(6, k) * torch.logspace(-2, 1, k)
    try:
        together = cpu_decode.linear(weights, x)  # six rows: tiles or pairs
        for r in range(x.shape[0]):
            cpu_decode.set_halves(lib, True)
            halves = cpu_decode.linear(weights, x[r:r + 1])
            cpu_decode.set_halves(lib, False)
            pairs = cpu_decode.linear(weights, x[r:r + 1])
            assert torch.equal(halves, pairs), f"row {r}: half registers against the pair kernels"
            assert torch.equal(halves[0], together[r]), f"row {r}: alone against in a batch of {x.shape[0]}"
    finally:
        cpu_decode.set_halves(lib, True)
    if kind == "int8":
        torch.manual_seed(7)
        qweight, scales = quantize_int8(torch.randn(84, k))
        bias = torch.randn(84)
        one = cpu_decode.linear(cpu_decode.LinearWeights.int8(qweight, scales, bias), x[:1])
        expected = torch.nn.functional.linear(quantize_activations_ref(x[:1], passes=2),
                                              qweight.float() * scales[:, None], bias)
        torch.testing.assert_close(one, expected, atol=1e-4, rtol=1e-4)
