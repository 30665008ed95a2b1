"""The Triton kernels with KAON_GPU_BATCH_INVARIANT's settings: a row's bits do not depend on the step (issue 49 §2).

Through Triton's interpreter on a CPU with support.row_dot's tl.dot (every row of a tile computed alike,
as a GPU computes them; the interpreter's own dot is not: see that module), so these tests prove the
kernels' part, tiles, loop bounds, masks and reduction orders, and a GPU lease checks the hardware's
(bench/gpu/engine_check.py check 5). On a GPU they run on the compiled kernels as they are.

- attention: a token's row from the prefill kernel alone (its whole prompt in one chunk) equals the same
  row in any chunk, at any start, beside other sequences' chunks, and as a decode row of any step,
  which the invariant backend runs through the same kernel (layers.attention.TritonAttentionBackend);
- the fused experts: a token's output alone equals it beside other tokens, whatever expert blocks it lands in;
- RMSNorm, rotary and SiLU-and-mul: a row alone equals it in a batch.
"""
from __future__ import annotations

import functools

import pytest
import torch

from kaon_runtime.kernels import moe, paged_attention
from kaon_runtime.kernels.activation import silu_and_mul
from kaon_runtime.kernels.moe_ref import moe_ref, route
from kaon_runtime.kernels.norm import rms_norm
from kaon_runtime.kernels.rotary import apply_rotary
from kaon_runtime.layers.activation import silu_and_mul as silu_and_mul_ref
from kaon_runtime.layers.attention import AttentionMetadata, PrefillChunk, TritonAttentionBackend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])  # bf16 dot: GPU only
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 16, 8
CONTEXT = 45  # the sequence under test; crosses float32's 32-row query tiles and 32-key tiles
NEIGHBOURS = (30, 19)  # other sequences' contexts, in the same pool
SCALE = HEAD_DIM ** -0.5


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


class Contexts:
    """Every sequence's keys, values and queries for all its positions, its K/V already in a shuffled pool."""

    def __init__(self, dtype):
        gen = torch.Generator().manual_seed(0)
        lens = (CONTEXT, *NEIGHBOURS)
        blocks = sum(-(-n // BLOCK_SIZE) for n in lens)
        order = torch.randperm(blocks, generator=gen).tolist()
        self.k = torch.zeros(KV_HEADS, blocks, BLOCK_SIZE, HEAD_DIM).to(dtype).to(DEVICE)
        self.v = torch.zeros_like(self.k)
        self.tables, self.queries, self.kv = [], [], []
        for n in lens:
            count = -(-n // BLOCK_SIZE)
            table, order = torch.tensor(order[:count], device=DEVICE), order[count:]
            positions = torch.arange(n)
            kv = [torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen).to(dtype).to(DEVICE) for _ in range(2)]
            for cache, values in zip((self.k, self.v), kv):
                cache[:, table[positions // BLOCK_SIZE].cpu(), positions % BLOCK_SIZE] = values.transpose(0, 1)
            self.tables.append(table)
            self.kv.append(kv)
            self.queries.append(torch.randn(n, HEADS, HEAD_DIM, generator=gen).to(dtype).to(DEVICE))

    def step(self, backend, decodes: list[tuple[int, int]], chunks: list[tuple[int, int, int]],
             window: int | None, softcap: float | None) -> list[torch.Tensor]:
        """One step as the model runner lays it out: decode rows (sequence, position) first, then prefill
        chunks (sequence, first position, length); each row's output, in that order."""
        rows = [(s, p) for s, p in decodes] + [(s, p) for s, a, n in chunks for p in range(a, a + n)]
        q = torch.stack([self.queries[s][p] for s, p in rows])
        k, v = (torch.stack([self.kv[s][i][p] for s, p in rows]) for i in range(2))  # the torch backend reads them
        meta = AttentionMetadata(slot_mapping=torch.full((len(rows),), -1, device=DEVICE),  # K/V already cached
                                 num_decode_tokens=len(decodes))
        if decodes:
            tables = [self.tables[s] for s, _ in decodes]
            width = max(t.numel() for t in tables)
            meta.decode_block_tables = torch.stack([torch.cat([t, t.new_zeros(width - t.numel())]) for t in tables])
            meta.decode_context_lens = torch.tensor([p + 1 for _, p in decodes], device=DEVICE)
        start = len(decodes)
        for s, first, n in chunks:
            end = first + n
            meta.prefills.append(PrefillChunk(start, n, end, self.tables[s][:-(-end // BLOCK_SIZE)]))
            start += n
        out = backend.forward(q, k, v, self.k, self.v, meta, SCALE, window, softcap)
        return list(out)


# (window, softcap): full causal; Mistral-like window shorter than a key tile; Gemma 2-like soft-capping.
SCORES = [(None, None), (6, None), (None, 30.0)]


@pytest.fixture
def gpu_like_split(monkeypatch):
    """Decode contexts cut into 16-key partitions as a GPU's partition_size would cut long ones (the
    interpreter never splits on its own): a decode kernel taking decode rows would merge partials here."""
    monkeypatch.setattr(paged_attention, "_auto_partition", lambda programs, max_len, device: 16)


@pytest.mark.parametrize("window,softcap", SCORES, ids=["causal", "window", "softcap"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_an_attention_row_does_not_depend_on_chunking_tiles_neighbours_or_kernel(dtype, window, softcap, row_dot,
                                                                                  gpu_like_split):
    ctx = Contexts(dtype)
    backend = TritonAttentionBackend(batch_invariant=True)
    alone = ctx.step(backend, [], [(0, 0, CONTEXT)], window, softcap)  # the whole prompt in one chunk
    # Chunks that start mid-tile and mid-block, of other lengths, after other sequences' rows.
    got = ctx.step(backend, [], [(1, 3, 7), (0, 0, 13)], window, softcap)[7:]
    got += ctx.step(backend, [(2, 18)], [(0, 13, 1 + 15), (1, 10, 20)], window, softcap)[1:17]
    got += ctx.step(backend, [], [(0, 29, 16)], window, softcap)
    # Decode rows (a one-token chunk, a generated token) beside other decodes and a prompt chunk.
    decode_positions = [0, 5, 17, 31, 44]
    for i, p in enumerate(decode_positions):
        decodes = [(2, 18), (1, 29)][:i % 3] + [(0, p)]
        got.append(ctx.step(backend, decodes, [(1, 0, 9)], window, softcap)[len(decodes) - 1])
    expected = alone + [alone[p] for p in decode_positions]
    differing = [i for i, (a, b) in enumerate(zip(got, expected)) if not _bits_equal(a, b)]
    assert not differing, f"rows {differing} of {len(expected)} differ from the sequence alone in one chunk"


@pytest.mark.parametrize("window,softcap", SCORES[:2], ids=["causal", "window"])
def test_the_invariant_rows_are_attention(window, softcap):
    """The invariant path computes what the reference does (a wrong kernel can be invariant too)."""
    from kaon_runtime.layers.attention import TorchAttentionBackend
    ctx = Contexts(torch.float32)
    step = ([(2, 18), (0, 44)], [(1, 0, 9), (0, 13, 16)])
    got = ctx.step(TritonAttentionBackend(batch_invariant=True), *step, window, softcap)
    expected = ctx.step(TorchAttentionBackend(), *step, window, softcap)
    torch.testing.assert_close(torch.stack(got), torch.stack(expected), atol=1e-5, rtol=1e-5)


def test_the_invariant_backend_never_runs_the_split_decode_kernel(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("decode rows went to the split decode kernel")
    monkeypatch.setattr(paged_attention, "decode_attention", refuse)
    ctx = Contexts(torch.float32)
    ctx.step(TritonAttentionBackend(batch_invariant=True), [(0, 10), (1, 3)], [(2, 0, 5)], None, None)
    with pytest.raises(AssertionError, match="split decode kernel"):
        ctx.step(TritonAttentionBackend(), [(0, 10)], [], None, None)


# --- the fused experts ---------------------------------------------------------------------------------

EXPERTS, TOP_K, HIDDEN, WIDTH = 6, 3, 32, 48


def _experts(dtype):
    gen = torch.Generator().manual_seed(1)
    w13 = (torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, generator=gen) * 0.2).to(dtype).to(DEVICE)
    w2 = (torch.randn(EXPERTS, HIDDEN, WIDTH, generator=gen) * 0.2).to(dtype).to(DEVICE)
    x = torch.randn(20, HIDDEN, generator=gen).to(dtype).to(DEVICE)
    router = torch.randn(20, EXPERTS, generator=gen).to(DEVICE)
    return x, w13, w2, *route(router, TOP_K, True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_experts_row_alone_equals_it_beside_other_tokens(dtype, row_dot):
    x, w13, w2, weights, ids = _experts(dtype)
    batched = moe.fused_moe(x, w13, w2, weights, ids, invariant=True)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(batched.float(), moe_ref(x, w13, w2, weights, ids, silu_and_mul_ref).float(),
                               atol=tolerance, rtol=tolerance)
    # Alone, and in smaller batches that put the token at other places of other experts' blocks.
    pieces = [moe.fused_moe(x[i:i + 1], w13, w2, weights[i:i + 1], ids[i:i + 1], invariant=True) for i in (0, 7, 19)]
    pieces.append(moe.fused_moe(x[5:12], w13, w2, weights[5:12], ids[5:12], invariant=True)[2])  # token 7
    assert _bits_equal(torch.cat([pieces[0], pieces[1], pieces[2], pieces[3][None]]),
                       torch.stack([batched[0], batched[7], batched[19], batched[7]]))


@pytest.mark.parametrize("top_k", [1, 2, 3, 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_slots_are_summed_in_slot_order_in_float32(dtype, top_k):
    x = torch.randn(9, top_k, 40, generator=torch.Generator().manual_seed(top_k)).to(dtype).to(DEVICE)
    expected = x[:, 0].float()
    for slot in range(1, top_k):
        expected = expected + x[:, slot].float()
    assert _bits_equal(moe.sum_slots(x), expected.to(dtype))


# --- per-row kernels ----------------------------------------------------------------------------------

@pytest.mark.parametrize("hidden", [48, 1000])
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_rotary_and_silu_rows_alone_equal_them_batched(dtype, hidden):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, hidden, generator=gen).to(dtype).to(DEVICE)
    residual = torch.randn(7, hidden, generator=gen).to(dtype).to(DEVICE)
    weight = torch.randn(hidden, generator=gen).to(dtype).to(DEVICE)
    normed, summed = rms_norm(x, weight, 1e-6, residual)
    for r in (0, 3, 6):
        one, one_sum = rms_norm(x[r:r + 1], weight, 1e-6, residual[r:r + 1])
        assert _bits_equal(one[0], normed[r]) and _bits_equal(one_sum[0], summed[r])
        assert _bits_equal(rms_norm(x[r:r + 1], weight, 1e-6)[0], rms_norm(x, weight, 1e-6)[r])
    gate_up = torch.randn(7, 2 * hidden, generator=gen).to(dtype).to(DEVICE)
    act = silu_and_mul(gate_up)
    assert all(_bits_equal(silu_and_mul(gate_up[r:r + 1])[0], act[r]) for r in (0, 3, 6))
    q = torch.randn(7, 3, 32, generator=gen).to(dtype).to(DEVICE)
    angles = torch.rand(7, 16, generator=gen).to(DEVICE) * 6
    rotated = apply_rotary(q, angles.cos().contiguous(), angles.sin().contiguous())
    for r in (0, 3, 6):
        one = apply_rotary(q[r:r + 1], angles[r:r + 1].cos().contiguous(), angles[r:r + 1].sin().contiguous())
        assert _bits_equal(one[0], rotated[r])


@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["plain", "gemma-offset"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_norms_torch_would_compute_take_the_per_row_kernel(dtype, offset):
    """Under the switch Gemma's offset norms and Qwen3's q/k norms over a [T, H, D] head view take the kernel
    (models/decoder.py): it computes torch's RMSNorm, and a head's row alone equals it in a batch."""
    from kaon_runtime.layers.norm import RMSNorm
    gen = torch.Generator().manual_seed(3)
    fused_qk = torch.randn(5, 6, 32, generator=gen).to(dtype).to(DEVICE)  # 4 query heads, 2 key heads
    q = fused_qk[:, :4]  # a strided view, as the decoder hands it over
    reference = RMSNorm(32, 1e-6, offset).to(DEVICE).requires_grad_(False)
    reference.weight.copy_(torch.randn(32, generator=gen) * 0.3 + (0.0 if offset else 1.0))
    reference = reference.to(dtype)
    got = rms_norm(q, reference.weight, 1e-6, weight_offset=offset)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, reference(q), atol=tolerance, rtol=tolerance)
    assert all(_bits_equal(rms_norm(q[t:t + 1], reference.weight, 1e-6, weight_offset=offset)[0], got[t])
               for t in (0, 2, 4))


# A mixture of experts whose slots' order matters (3 of 5), routed through the invariant GEMM.
MOE = dict(num_experts=5, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True)


@pytest.mark.parametrize("variant", ["qk-norm", "gemma2", "moe"])
def test_the_decoder_under_the_switch_computes_the_torch_models_step(variant, monkeypatch):
    """The switch's wiring in the decoder (models/decoder.py): Qwen3's q/k norms, Gemma's offset and sandwich
    norms on the Triton kernel, with Gemma 2's window and soft-capping through the invariant attention; the
    experts' router through the invariant GEMM and their slots summed in order; a mixed step (decodes and a
    prompt chunk) gives the torch model's hidden states and cache."""
    if DEVICE == "cuda":
        pytest.skip("the CPU models of test_cpu_decode (the same kernels run in the GPU's engine checks)")
    from test_cpu_decode import BLOCK, WINDOWS, mixed_step, tiny_config

    from kaon_runtime.kernels import invariant_gemm
    from kaon_runtime.layers.kernel_backend import torch_kernels, triton_kernels
    from kaon_runtime.models.registry import build_model
    monkeypatch.setenv("KAON_GPU_BATCH_INVARIANT", "1")
    config = tiny_config(**(MOE if variant == "moe" else WINDOWS[variant]))
    weights_seen = []  # the weights the invariant GEMM multiplied by: the router's among them
    gemm = invariant_gemm.linear

    def seen(x, w, *args, **kwargs):
        weights_seen.append(tuple(w.shape))
        return gemm(x, w, *args, **kwargs)
    monkeypatch.setattr(invariant_gemm, "linear", seen)
    torch.manual_seed(3)
    cache = torch.randn(config.num_layers, 2, config.num_kv_heads, 10, BLOCK, config.head_dim)
    outputs = []
    for kernels in (torch_kernels(False), triton_kernels(False)):
        torch.manual_seed(3)
        model = build_model(config, kernels=kernels).float()
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 1.0) + (1.0 if p.dim() == 1 else 0.0))
        layers_cache = cache.clone()
        for i, attn in enumerate(model.attention_layers()):
            attn.k_cache, attn.v_cache = layers_cache[i, 0], layers_cache[i, 1]
        x, positions, meta = mixed_step(config)
        with torch.inference_mode():
            outputs.append((model.model(x, positions, meta), layers_cache))
    layer = model.model.layers[0]
    assert layer.self_attn.attn.backend.batch_invariant
    if variant == "moe":
        assert isinstance(layer.mlp.kernel, functools.partial)  # fused_moe, invariant=True
        assert (MOE["num_experts"], config.hidden_size) in weights_seen, "the router skipped the invariant GEMM"
    else:
        norms = [layer.input_layernorm] + ([layer.self_attn.q_norm, layer.self_attn.k_norm] if variant == "qk-norm"
                                           else [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm])
        assert all(norm.kernel is not None for norm in norms)
    (expected, expected_cache), (got, got_cache) = outputs
    torch.testing.assert_close(got_cache, expected_cache, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
