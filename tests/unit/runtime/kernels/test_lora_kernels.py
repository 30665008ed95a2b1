"""Batched LoRA: the Triton shrink/expand kernels (through Triton's interpreter without a GPU) and the
CPU path of LoraLinear, each against the gathered torch reference (kernels.lora_ref)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from kaon_runtime.kernels.lora_ref import lora_expand_ref, lora_shrink_ref
from kaon_runtime.layers.lora import LoraBatch, LoraLinear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Tokens of three adapters and of the base (-1), interleaved, one slot left unused.
SLOTS = [2, -1, 0, 0, 2, -1, 1, 0]


def _pool(num_slots, rank, fan_in, fan_out, dtype=torch.float32):
    torch.manual_seed(0)
    a = torch.randn(num_slots, rank, fan_in, device=DEVICE).to(dtype)
    b = torch.randn(num_slots, rank, fan_out, device=DEVICE).to(dtype)
    return a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank,fan_in,fan_out", [(8, 64, 96), (5, 100, 33)])
def test_triton_shrink_and_expand_match_the_reference(dtype, rank, fan_in, fan_out):
    from kaon_runtime.kernels.lora import lora_expand, lora_shrink
    a, b = _pool(4, rank, fan_in, fan_out, dtype)
    slots = torch.tensor(SLOTS, device=DEVICE)
    x = torch.randn(len(SLOTS), fan_in, device=DEVICE).to(dtype)
    shrunk = lora_shrink(x, a, slots)
    torch.testing.assert_close(shrunk, lora_shrink_ref(x, a, slots), rtol=1e-4, atol=1e-3)
    # Into a column slice of a wider output, as for q of a fused q|k|v projection.
    y = torch.randn(len(SLOTS), fan_out + 16, device=DEVICE).to(dtype)
    expected = y.clone()
    lora_expand_ref(expected[:, 16:], shrunk, b, slots)
    lora_expand(y[:, 16:], shrunk, b, slots)
    close = dict(rtol=1e-4, atol=1e-3) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-1)
    torch.testing.assert_close(y, expected, **close)
    base_rows = torch.tensor(SLOTS, device=DEVICE) < 0
    assert torch.equal(y[base_rows], expected[base_rows])


def test_cpu_lora_linear_matches_the_reference_on_a_fused_projection():
    """Grouped by slot, the parts of q|k|v stacked in one A and a block-diagonal B, adapters of ranks below
    the pool's; against the per-part reference, and against each adapter's own A and B."""
    torch.manual_seed(1)
    fan_in, parts, num_slots, max_rank = 32, [16, 8, 8], 3, 8
    base = nn.Linear(fan_in, sum(parts), bias=False)
    batch = LoraBatch()
    lora = LoraLinear(base, fan_in, parts, num_slots, max_rank, batch, torch.float32, torch.device("cpu"))
    given = {}
    for slot, rank in enumerate([4, 8, 2]):
        for part, size in enumerate(parts):
            if (slot, part) != (2, 1):  # one adapter leaves k alone
                given[slot, part] = torch.randn(rank, fan_in), torch.randn(size, rank)
                lora.load_slot(slot, part, *given[slot, part])
    x = torch.randn(len(SLOTS), fan_in)
    batch.set(SLOTS, torch.device("cpu"))
    got = lora(x)
    expected, direct = base(x), base(x)
    slots = torch.tensor(SLOTS)
    for part, (offset, size) in enumerate(zip(lora.offsets, parts)):
        a, b = lora.part_weights(part)
        lora_expand_ref(expected[:, offset:offset + size], lora_shrink_ref(x, a, slots), b, slots)
    for row, slot in enumerate(SLOTS):
        for part, (offset, size) in enumerate(zip(lora.offsets, parts)):
            if (slot, part) in given:
                a, b = given[slot, part]
                direct[row, offset:offset + size] += b @ (a @ x[row])
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got, direct, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, base(x))
    batch.set([-1] * len(SLOTS), torch.device("cpu"))
    assert not batch.active
    torch.testing.assert_close(lora(x), base(x), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_lora_delta_of_a_token_does_not_depend_on_the_token_count(dtype):
    """The GPU switch (KAON_GPU_BATCH_INVARIANT=1) needs nothing from kernels/lora.py: each program reads one
    token, its shrink sums fan_in in BLOCK_K steps and its expand the rank, in orders fixed by the adapter's
    shape. So a token's delta has the same bits alone as among others (prefixes of one batch; in Triton's
    interpreter, which shows it for this module's launch decisions, not for a GPU's instructions)."""
    from kaon_runtime.kernels.lora import lora_expand, lora_shrink
    a, b = _pool(4, 8, 200, 72, dtype)
    tokens = SLOTS * 9  # 72 tokens
    slots = torch.tensor(tokens, device=DEVICE)
    x = torch.randn(len(tokens), 200, device=DEVICE).to(dtype)
    y = torch.randn(len(tokens), 72, device=DEVICE).to(dtype)

    def delta(rows: int) -> torch.Tensor:
        out = y[:rows].clone()
        lora_expand(out, lora_shrink(x[:rows], a, slots[:rows]), b, slots[:rows])
        return out

    full = delta(len(tokens))
    for rows in (1, 3, 8, 40):
        assert torch.equal(delta(rows), full[:rows])
