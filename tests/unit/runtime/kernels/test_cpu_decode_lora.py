"""LoRA inside the fused CPU decode step (kernels/cpu_decode.c) against the torch path (layers.lora's
grouped matmuls): a tiny random Llama with every projection wrapped, slots holding adapters of
different ranks and target modules, rows of several adapters and of the base in one step; float32,
int8 and int4 base weights, and a mixed step whose decodes take the C step and its prefill torch.
Whole models against transformers + peft through this step: tests/unit/runtime/engine/test_lora.py."""
from __future__ import annotations

import pytest
import torch

from kaon_runtime.config import ModelConfig
from kaon_runtime.kernels import cpu_decode
from kaon_runtime.kernels.quant_gemm_ref import quantize_activations_ref
from kaon_runtime.layers.attention import AttentionMetadata, PrefillChunk
from kaon_runtime.layers.kernel_backend import torch_kernels
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


def model_with_adapters(method: str | None):
    """A random model (quantized by `method`), every projection wrapped, the slots filled; and its pool."""
    torch.manual_seed(3)
    model = build_model(CONFIG, kernels=torch_kernels(True)).float()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 1.0) + (1.0 if p.dim() == 1 else 0.0))
    quantized = [model.get_submodule(name) for name in quantize_model(model, method)] if method else []
    cache = torch.randn(CONFIG.num_layers, 2, CONFIG.num_kv_heads, 10, BLOCK, CONFIG.head_dim)
    for i, attn in enumerate(model.attention_layers()):
        attn.k_cache, attn.v_cache = cache[i, 0], cache[i, 1]
    batch, targets = attach_lora(model, len(ADAPTERS), MAX_RANK, torch.float32, torch.device("cpu"))
    for slot, (rank, modules) in ADAPTERS.items():
        for (_, proj), (lora, part) in targets.items():
            fan_in, fan_out = lora.a.shape[2], lora.parts[part]
            on = proj in modules
            lora.load_slot(slot, part, torch.randn(rank, fan_in) * 0.3 if on else None,
                           torch.randn(fan_out, rank) * 0.3 if on else None)
    return model.eval(), cache, batch, quantized


def decode_step():
    torch.manual_seed(4)
    widest = max(map(len, TABLES))
    slots = torch.tensor([t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for t, n in zip(TABLES, LENS)])
    meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=len(LENS),
                             decode_block_tables=torch.tensor([t + [0] * (widest - len(t)) for t in TABLES]),
                             decode_context_lens=torch.tensor(LENS))
    return torch.randn(len(LENS), CONFIG.hidden_size), torch.tensor([n - 1 for n in LENS]), meta


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
