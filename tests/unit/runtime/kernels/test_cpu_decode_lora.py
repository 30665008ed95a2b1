"""LoRA inside the fused CPU decode step (kernels/cpu_decode.c) against the torch path (layers.lora's
grouped matmuls): a tiny random Llama with every projection wrapped, slots holding adapters of
different ranks and target modules, rows of several adapters and of the base in one step; float32,
int8 and int4 base weights, and a mixed step whose decodes take the C step and its prefill torch.
float16 / bfloat16 models keep their slots in their dtype: the C step widens them as it reads them, so
a half model's step with adapters is the float32 step on the same values bit for bit, each row's alone.
Whole models against transformers + peft through this step: tests/unit/runtime/engine/test_lora.py."""
from __future__ import annotations

import pytest
import torch

from kaon_runtime.config import ModelConfig
from kaon_runtime.kernels import cpu_decode
from kaon_runtime.kernels.quant_gemm_ref import quantize_activations_ref
from kaon_runtime.layers.attention import AttentionMetadata, PrefillChunk
from kaon_runtime.layers.kernel_backend import torch_kernels
from kaon_runtime.layers.lora import LoraLinear
from kaon_runtime.models.lora_targets import TARGETS, attach_lora
from kaon_runtime.models.registry import build_model
from kaon_runtime.quant import quantize_model

pytestmark = pytest.mark.skipif(cpu_decode.compiler() is None, reason=cpu_decode.NO_COMPILER)  # a compile error fails

BLOCK = 4
CONFIG = ModelConfig(architecture="llama", vocab_size=100, hidden_size=64, intermediate_size=96, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64)
MAX_RANK = 8
# slot -> (rank, target modules): everything at the full rank; part of attention and the MLP, at ranks
# padded to the pool's
ADAPTERS = {0: (8, list(TARGETS)), 1: (3, ["q_proj", "v_proj", "o_proj"]),
            2: (5, ["gate_proj", "up_proj", "down_proj"])}
TABLES, LENS = [[5], [2, 9, 0], [7, 3], [6], [8]], [1, 12, 6, 3, 2]
ROW_SLOTS = [2, -1, 0, 1, 0]  # rows of three adapters and the base, slot 0 twice and not side by side
# The C step takes up to four rows of one slot together: groups of 1 to 4 (and 4 + 1).
GROUPED = [ROW_SLOTS, [0, 0, 0, 0, 0], [1, -1, 1, 1, 2]]


def model_with_adapters(method: str | None, dtype: torch.dtype = torch.float32, values: torch.dtype | None = None):
    """A random model (quantized by `method`), every projection wrapped, the slots filled; and its pool.
    dtype: the model's and its slots' (a half model's slots are in its dtype, as the engine makes them);
    values: the weights' and adapters' values rounded to this dtype first (the same values in a float32 model)."""
    torch.manual_seed(3)
    model = build_model(CONFIG, kernels=torch_kernels(True)).float()
    rounded = (lambda t: t.to(values).float()) if values is not None else (lambda t: t)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(rounded(torch.randn_like(p) * (0.3 if p.dim() > 1 else 1.0) + (1.0 if p.dim() == 1 else 0.0)))
    model = model.to(dtype)
    quantized = [model.get_submodule(name) for name in quantize_model(model, method)] if method else []
    cache = torch.randn(CONFIG.num_layers, 2, CONFIG.num_kv_heads, 10, BLOCK, CONFIG.head_dim)
    for i, attn in enumerate(model.attention_layers()):
        attn.k_cache, attn.v_cache = cache[i, 0], cache[i, 1]
    batch, targets = attach_lora(model, len(ADAPTERS), MAX_RANK, dtype, torch.device("cpu"))
    for slot, (rank, modules) in ADAPTERS.items():
        for (_, proj), (lora, part) in targets.items():
            fan_in, fan_out = lora.a.shape[2], lora.parts[part]
            on = proj in modules
            lora.load_slot(slot, part, rounded(torch.randn(rank, fan_in) * 0.3) if on else None,
                           rounded(torch.randn(fan_out, rank) * 0.3) if on else None)
    return model.eval(), cache, batch, quantized


def decode_step(rows: list[int] | None = None):
    """A decode step of the sequences TABLES, LENS (or of those `rows` of them; each row's input as in the whole)."""
    torch.manual_seed(4)
    x = torch.randn(len(LENS), CONFIG.hidden_size)
    rows = list(range(len(LENS))) if rows is None else rows
    tables, lens = [TABLES[r] for r in rows], [LENS[r] for r in rows]
    widest = max(map(len, tables))
    slots = torch.tensor([t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for t, n in zip(tables, lens)])
    meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=len(lens),
                             decode_block_tables=torch.tensor([t + [0] * (widest - len(t)) for t in tables]),
                             decode_context_lens=torch.tensor(lens))
    return x[rows], torch.tensor([n - 1 for n in lens]), meta


def run_both(model, cache, batch, row_slots, x, positions, meta, quantized=()):
    """The torch path's output and cache (the C step's activation rounding put before each quantized
    base projection), then the C step's, each step with the same adapters."""
    step = model.model.cpu_decode
    start = cache.clone()
    with torch.inference_mode():
        model.model.cpu_decode = None
        hooks = [m.register_forward_pre_hook(lambda _, args: (quantize_activations_ref(args[0]),))
                 for m in quantized]
        batch.set(row_slots, x.device)
        expected, expected_cache = model.model(x.clone(), positions, meta), cache.clone()
        for hook in hooks:
            hook.remove()
        model.model.cpu_decode = step
        cache.copy_(start)
        meta.decode_key_mask = None
        batch.set(row_slots, x.device)
        assert step.reads_lora()
        out = model.model(x.clone(), positions, meta)
    return expected, expected_cache, out, cache.clone()


@pytest.mark.parametrize("method,row_slots", [(None, GROUPED[0]), ("int8", GROUPED[0]), ("int4", GROUPED[0]),
                                              (None, GROUPED[1]), (None, GROUPED[2])])
def test_a_decode_step_with_adapters_matches_the_torch_path(method, row_slots, monkeypatch):
    monkeypatch.setenv("KAON_QUANT_KERNEL", "torch")  # the dequantizing reference, fed the C step's activations
    model, cache, batch, quantized = model_with_adapters(method)
    model.check_kernels()
    x, positions, meta = decode_step()
    expected, expected_cache, out, got_cache = run_both(model, cache, batch, row_slots, x, positions, meta, quantized)
    _, _, base, _ = run_both(model, cache, batch, [-1] * len(LENS), x, positions, meta, quantized)
    changed = (expected - base).norm(dim=1) / base.norm(dim=1)
    assert all(changed[r] > 0.05 for r, slot in enumerate(row_slots) if slot >= 0), "each adapter must count"
    assert all(torch.equal(out[r], base[r]) for r, slot in enumerate(row_slots) if slot < 0), "base rows get nothing"
    tolerance = 1e-5 if method is None else 1e-4
    assert ((out - expected).norm(dim=1) / expected.norm(dim=1)).max() < tolerance
    torch.testing.assert_close(got_cache, expected_cache, atol=1e-5, rtol=1e-5)  # k and v carry the adapters too


@pytest.mark.parametrize("prefill", ["fused", "torch"])
def test_a_mixed_steps_adapters_apply_to_its_decodes_and_its_prefill(prefill, monkeypatch):
    """KAON_CPU_PREFILL=fused (the default): the prefill's rows take their adapter in the C step too;
    torch: the decodes in the C step, the prefill through torch. Both against the torch path."""
    monkeypatch.setenv("KAON_CPU_PREFILL", prefill)
    model, cache, batch, _ = model_with_adapters(None)
    model.check_kernels()
    x, positions, meta = decode_step()
    # A new 5-token prompt of adapter 1 in blocks 1 and 4 rides along after the decodes.
    decodes = len(LENS)
    meta.prefills = [PrefillChunk(query_start=decodes, query_len=5, context_len=5, block_table=torch.tensor([1, 4]))]
    x = torch.cat([x, torch.randn(5, CONFIG.hidden_size)])
    positions = torch.cat([positions, torch.arange(5)])
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.tensor([4, 5, 6, 7, 16])])
    step = model.model.cpu_decode
    assert step.applies(x, meta) if prefill == "fused" else step.applies_to_decodes_of(meta)
    expected, expected_cache, out, got_cache = run_both(model, cache, batch, ROW_SLOTS + [1] * 5, x, positions, meta)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_cache, expected_cache, atol=1e-5, rtol=1e-5)


HALVES = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("method", [None, "int4"])
@pytest.mark.parametrize("dtype", HALVES)
def test_a_half_models_adapters_are_the_float32_steps_on_the_same_values(dtype, method):
    """A float16 / bfloat16 model with half slots: its step with adapters (rows of three adapters and the base)
    equals the float32 model's with float32 slots holding the same values, bit for bit (the float32 step is
    held to torch's by the tests above); --dtype bfloat16 --quantization int4 too."""
    results = []
    for model_dtype in (torch.float32, dtype):
        model, cache, batch, _ = model_with_adapters(method, model_dtype, values=dtype)
        model.check_kernels()
        assert model.model.cpu_decode.reads_lora(), "the C step reads the slots"
        x, positions, meta = decode_step()
        start = cache.clone()
        with torch.inference_mode():
            batch.set(ROW_SLOTS, x.device)
            out, after = model.model(x.to(dtype).to(model_dtype), positions, meta), cache.clone()
            cache.copy_(start)
            batch.set([-1] * len(ROW_SLOTS), x.device)
            base = model.model(x.to(dtype).to(model_dtype), positions, meta)
        results.append((out, after, base))
    (full, full_cache, full_base), (half, half_cache, _) = results
    assert half.dtype == dtype
    assert all(not torch.equal(full[r], full_base[r]) for r, slot in enumerate(ROW_SLOTS) if slot >= 0)
    assert torch.equal(half, full.to(dtype)) and torch.equal(half_cache, full_cache)


@pytest.mark.parametrize("dtype", HALVES)
def test_a_half_models_row_with_an_adapter_gets_the_same_bits_alone_or_batched(dtype):
    """Each row of a step of three adapters and the base (slot 0 twice, apart), computed alone, is the
    batched row bit for bit, output and stored keys and values (the slot's rows go through its weights
    up to four at a time, each in its own sums)."""
    model, cache, batch, _ = model_with_adapters(None, dtype)
    model.check_kernels()
    start = cache.clone()
    x, positions, meta = decode_step()
    with torch.inference_mode():
        batch.set(ROW_SLOTS, x.device)
        together, together_cache = model.model(x.to(dtype), positions, meta), cache.clone()
        for r, slot in enumerate(ROW_SLOTS):
            cache.copy_(start)
            x1, positions1, meta1 = decode_step([r])
            batch.set([slot], x.device)
            alone = model.model(x1.to(dtype), positions1, meta1)
            assert torch.equal(alone[0], together[r]), f"row {r} (slot {slot})"
            written = meta1.slot_mapping[0]
            block, offset = divmod(int(written), BLOCK)
            assert torch.equal(cache[:, :, :, block, offset], together_cache[:, :, :, block, offset]), f"row {r}"


# The C step's LoRA terms (a row's output with its adapter less its output without) against torch's half path
# (layers/lora.py: x @ A.T then @ B in the model's dtype, each rounded to it), relative: each half dtype's
# rounding of a whole step (float16's 2^-11, bfloat16's 2^-8 a value, through two layers).
HALF_TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 4e-2}


@pytest.mark.parametrize("dtype", HALVES)
def test_a_half_models_lora_terms_match_torchs_half_path_within_its_rounding(dtype):
    model, cache, batch, _ = model_with_adapters(None, dtype)
    model.check_kernels()
    x, positions, meta = decode_step()
    x = x.to(dtype)
    expected, _, out, _ = run_both(model, cache, batch, ROW_SLOTS, x, positions, meta)
    expected_base, _, base, _ = run_both(model, cache, batch, [-1] * len(ROW_SLOTS), x, positions, meta)
    for r, slot in enumerate(ROW_SLOTS):
        if slot < 0:
            continue
        term, torch_term = (out[r] - base[r]).float(), (expected[r] - expected_base[r]).float()
        assert term.norm() > 0.05 * base[r].float().norm(), "each adapter must count"
        assert (term - torch_term).norm() / torch_term.norm() < HALF_TOLERANCE[dtype], f"row {r} (slot {slot})"


@pytest.mark.parametrize("dtype", HALVES)
def test_a_half_models_slots_are_read_in_place_so_later_loads_are_seen(dtype):
    """The step's structs are built on its first call; an adapter emptied from its slot afterwards, and loaded
    again, is seen at once: its rows become the base's, then what they were."""
    model, cache, batch, _ = model_with_adapters(None, dtype)
    model.check_kernels()
    start = cache.clone()
    x, positions, meta = decode_step()

    def step(row_slots):
        cache.copy_(start)
        with torch.inference_mode():
            batch.set(row_slots, x.device)
            return model.model(x.to(dtype), positions, meta)

    first, base = step(ROW_SLOTS), step([-1] * len(ROW_SLOTS))
    targets = [(m, part) for m in model.modules() if isinstance(m, LoraLinear) for part in range(len(m.parts))]
    saved = [(m.a.clone(), m.b.clone(), m.ranks.clone()) for m, _ in targets]
    for m, part in targets:
        m.load_slot(0, part, None, None)
    emptied = step(ROW_SLOTS)
    for (m, _), (a, b, ranks) in zip(targets, saved):
        m.a.copy_(a)
        m.b.copy_(b)
        m.ranks.copy_(ranks)
    for r, slot in enumerate(ROW_SLOTS):
        assert torch.equal(emptied[r], base[r] if slot == 0 else first[r]), f"row {r} (slot {slot})"
    assert torch.equal(step(ROW_SLOTS), first)
