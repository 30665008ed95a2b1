"""Triton paged attention against the pure-torch references (through Triton's interpreter when there is no GPU).

Contexts sit in shuffled blocks of a shared pool, so a kernel that assumed contiguous
blocks, or read another sequence's blocks, would fail.
"""
from __future__ import annotations

import pytest
import torch

from kaon_runtime.kernels import paged_attention_ref as ref
from kaon_runtime.kernels.paged_attention import decode_attention, prefill_attention
from kaon_runtime.layers.attention import (
    AttentionMetadata,
    PrefillChunk,
    TorchAttentionBackend,
    TritonAttentionBackend,
    select_backend,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter multiplies bfloat16 matrices wrongly (tl.dot on bf16 operands), so bf16 is checked on GPUs only.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3),
             torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


class Pool:
    """A KV pool whose blocks are handed out in random order."""

    def __init__(self, kv_heads, head_dim, block_size, dtype, num_blocks=64):
        self.k = torch.randn(kv_heads, num_blocks, block_size, head_dim, device=DEVICE).to(dtype)
        self.v = torch.randn(kv_heads, num_blocks, block_size, head_dim, device=DEVICE).to(dtype)
        self.block_size = block_size
        self._free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()

    def table(self, context_len: int) -> torch.Tensor:
        n = -(-context_len // self.block_size)
        blocks, self._free = self._free[:n], self._free[n:]
        return torch.tensor(blocks, device=DEVICE)

    def write(self, key, value, table, first_pos):
        positions = torch.arange(first_pos, first_pos + key.shape[0], device=DEVICE)
        slots = table[positions // self.block_size] * self.block_size + positions % self.block_size
        ref.write_kv_cache_ref(key, value, self.k, self.v, slots)


def _padded(tables):
    width = max(t.numel() for t in tables)
    return torch.stack([torch.cat([t, t.new_zeros(width - t.numel())]) for t in tables])


def _randn(*shape, dtype):
    return torch.randn(*shape, device=DEVICE).to(dtype)


# (query_len, context_len) per chunk: a fresh prompt, one starting mid-block and crossing query and key
# tiles, one whose context ends exactly on a block boundary, a two-token chunk far into its context.
PREFILL_BATCHES = {
    "fresh": [(37, 37)],
    "mid-block": [(70, 155)],
    "mixed": [(5, 5), (40, 96), (2, 130), (17, 17)],
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", sorted(PREFILL_BATCHES))
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(4, 4, 16, 16), (6, 2, 24, 8), (4, 1, 32, 32)])
def test_prefill_matches_reference(dtype, batch, heads, kv_heads, head_dim, block_size):
    torch.manual_seed(0)
    pool = Pool(kv_heads, head_dim, block_size, dtype)
    chunks = PREFILL_BATCHES[batch]
    decode_rows = 3  # rows ahead of the chunks that prefill must leave alone
    total = decode_rows + sum(q for q, _ in chunks)
    query = _randn(total, heads, head_dim, dtype=dtype)
    keys, values = _randn(total, kv_heads, head_dim, dtype=dtype), _randn(total, kv_heads, head_dim, dtype=dtype)
    scale = head_dim ** -0.5
    expected = torch.zeros_like(query)
    tables, starts = [], []
    start = decode_rows
    for query_len, context_len in chunks:
        table = pool.table(context_len)
        rows = slice(start, start + query_len)
        pool.write(keys[rows], values[rows], table, context_len - query_len)
        expected[rows] = ref.prefill_attention_ref(query[rows], keys[rows], values[rows], pool.k, pool.v, table,
                                                   context_len, scale)
        tables.append(table)
        starts.append(start)
        start += query_len
    out = torch.zeros_like(query)
    query_lens, context_lens = zip(*chunks)
    prefill_attention(query, pool.k, pool.v, _padded(tables), *(torch.tensor(x, device=DEVICE) for x in
                      (starts, query_lens, context_lens)), max(query_lens), scale, out)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (8, 2), (7, 1)])
@pytest.mark.parametrize("partition_size", [None, 48, 8])  # whole context; uneven; more than one merge tile
def test_decode_matches_reference(dtype, heads, kv_heads, partition_size):
    torch.manual_seed(0)
    head_dim, block_size = 32, 16
    pool = Pool(kv_heads, head_dim, block_size, dtype)
    # One token, exactly one block, a partial last block, and a context whose partitions do not divide evenly.
    context_lens = [1, 16, 37, 200]
    tables = _padded([pool.table(n) for n in context_lens])
    lens = torch.tensor(context_lens, device=DEVICE)
    key_mask = torch.arange(tables.shape[1] * block_size, device=DEVICE)[None, :] < lens[:, None]
    query = _randn(len(context_lens), heads, head_dim, dtype=dtype)
    scale = head_dim ** -0.5
    expected = ref.decode_attention_ref(query, pool.k, pool.v, tables, key_mask, scale)
    out = torch.zeros_like(query)
    decode_attention(query, pool.k, pool.v, tables, lens, scale, out, partition_size=partition_size)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("sizing_context", [1 << 13, 16], ids=["a-program-per-partition", "strided"])
def test_split_decode_merges_in_its_one_launch_and_leaves_its_counters_at_zero(monkeypatch, sizing_context):
    """Split decodes merge in the decode kernel itself (the last partition of a sequence to finish): one launch
    per call, split or not, as a CUDA graph replays it whatever the contexts have grown to. The arrival
    counters must be back at zero after each launch, or the next launch's merge happens at the wrong count.
    Strided: programs sized for 16-key contexts, so each takes several 16-key partitions of the longer ones."""
    from kaon_runtime.kernels import paged_attention
    monkeypatch.setattr(paged_attention, "_SIZING_CONTEXT", sizing_context)
    assert paged_attention.decode_programs(8, 16, 128) == min(8, sizing_context // 16)
    launches = []
    kernels = [k for k in vars(paged_attention).values() if hasattr(k, "arg_names") and hasattr(k, "run")]
    for kernel in kernels:
        def run(*args, _run=kernel.run, _name=kernel.fn.__name__, **kwargs):
            launches.append(_name)
            return _run(*args, **kwargs)
        monkeypatch.setattr(kernel, "run", run)
    torch.manual_seed(0)
    pool = Pool(2, 16, 8, torch.float32)
    tables = _padded([pool.table(n) for n in (40, 3, 70)])
    for context_lens in ([40, 3, 70], [41, 4, 9]):  # the same tables a step later, and after a long one ended
        lens = torch.tensor(context_lens, device=DEVICE)
        key_mask = torch.arange(tables.shape[1] * 8, device=DEVICE)[None, :] < lens[:, None]
        query = _randn(3, 4, 16, dtype=torch.float32)
        expected = ref.decode_attention_ref(query, pool.k, pool.v, tables, key_mask, 0.25)
        out = torch.zeros_like(query)
        launches.clear()
        decode_attention(query, pool.k, pool.v, tables, lens, 0.25, out, partition_size=16)
        assert launches == ["_decode_kernel"]
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
        assert not paged_attention._COUNTERS[query.device].any()


def test_decode_reads_a_strided_query_and_writes_a_view():
    """The model hands q over as a view of its fused qkv and reads the output from a slice of a larger buffer."""
    torch.manual_seed(0)
    pool = Pool(2, 16, 16, torch.float32)
    tables = _padded([pool.table(20), pool.table(3)])
    lens = torch.tensor([20, 3], device=DEVICE)
    key_mask = torch.arange(tables.shape[1] * 16, device=DEVICE)[None, :] < lens[:, None]
    qkv = _randn(2, 8, 16, dtype=torch.float32)
    query = qkv[:, :4]
    expected = ref.decode_attention_ref(query, pool.k, pool.v, tables, key_mask, 0.25)
    out = torch.zeros(5, 4, 16, device=DEVICE)
    decode_attention(query, pool.k, pool.v, tables, lens, 0.25, out[:2], partition_size=16)
    torch.testing.assert_close(out[:2], expected, atol=1e-4, rtol=1e-4)
    assert not out[2:].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_backend_matches_torch_backend_on_a_mixed_batch(dtype):
    """Decodes first, then prefill chunks, the way the model runner lays out a step."""
    torch.manual_seed(0)
    heads, kv_heads, head_dim, block_size = 4, 2, 16, 8
    pool = Pool(kv_heads, head_dim, block_size, dtype)
    decode_lens, chunks = [9, 1, 24], [(6, 6), (11, 30)]  # context lengths; (query_len, context_len)
    decode_tables = [pool.table(n) for n in decode_lens]
    chunk_tables = [pool.table(c) for _, c in chunks]
    positions = [n - 1 for n in decode_lens] + [p for q, c in chunks for p in range(c - q, c)]
    tables = decode_tables + [t for t, (q, _) in zip(chunk_tables, chunks) for _ in range(q)]
    slots = torch.stack([t[p // block_size] * block_size + p % block_size for t, p in zip(tables, positions)])
    padded = _padded(decode_tables)
    lens = torch.tensor(decode_lens, device=DEVICE)
    prefills, start = [], len(decode_lens)
    for (query_len, context_len), table in zip(chunks, chunk_tables):
        prefills.append(PrefillChunk(start, query_len, context_len, table))
        start += query_len
    meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=len(decode_lens), decode_block_tables=padded,
                             decode_context_lens=lens, prefills=prefills,
                             decode_key_mask=torch.arange(padded.shape[1] * block_size, device=DEVICE) < lens[:, None])
    q = _randn(len(positions), heads, head_dim, dtype=dtype)
    k, v = (_randn(len(positions), kv_heads, head_dim, dtype=dtype) for _ in range(2))
    results = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        caches = pool.k.clone(), pool.v.clone()
        results.append((backend.forward(q, k, v, *caches, meta, head_dim ** -0.5), *caches))
    (expected, *expected_caches), (out, *caches) = results
    torch.testing.assert_close(caches, expected_caches, rtol=0, atol=0)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


def test_backend_selection(monkeypatch):
    monkeypatch.delenv("KAON_ATTENTION_BACKEND", raising=False)
    assert select_backend(torch.device("cpu")).name == "torch"
    assert select_backend(torch.device("cuda")).name == "triton"
    monkeypatch.setenv("KAON_ATTENTION_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_backend(torch.device("cpu")).name == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA device"):
        select_backend(torch.device("cpu"))
    monkeypatch.setenv("KAON_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match="unknown KAON_ATTENTION_BACKEND"):
        select_backend(torch.device("cpu"))


@pytest.mark.parametrize("programs,max_len,expected", [
    (8, 512, 256),  # batch 1, 8 KV heads, short contexts: the smallest partition
    (8, 8192, 256),  # batch 1, 8K: 32 partitions per head, 256 programs for 132 SMs
    (8, 131072, 256),  # a graph's 128K-wide tables are sized like 8K, not cut into 32 4K-key slices
    (2048, 131072, 8192),  # batch 256 fills the GPU alone: one partition per 8K keys
    (96, 4096, 2048),  # batch 12: a split in two
])
def test_decode_partitions_fill_an_h100_whatever_the_table_width(programs, max_len, expected):
    from kaon_runtime.kernels.paged_attention import partition_size
    assert partition_size(programs, max_len, num_sms=132) == expected


# ---- sliding windows and soft-capping (Mistral, Gemma 2, ...) --------------------------------------

def _naive_attention(query, keys, values, query_pos, scale, window, softcap):
    """Row by row over a contiguous context [L, Hkv, D]: the query at position p sees keys max(0, p - window + 1)..p."""
    heads, kv_heads = query.shape[1], keys.shape[1]
    out = torch.empty_like(query)
    for row, pos in enumerate(query_pos):
        first = 0 if window is None else max(0, pos - window + 1)
        k = keys[first:pos + 1].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1).float()  # [H, n, D]
        v = values[first:pos + 1].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1).float()
        scores = torch.einsum("hd,hnd->hn", query[row].float(), k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        out[row] = torch.einsum("hn,hnd->hd", torch.softmax(scores, dim=-1), v).to(query.dtype)
    return out


WINDOWED = [(None, 2.0), (1, None), (7, None), (33, 5.0), (300, None)]  # (window, softcap); 300: wider than any context
# The window and softcap variants, in Triton's interpreter without a GPU, are 20 cases of 1-5 s (39 s of the
# file's 86 s on a 2-vCPU Zen 2, 2026-11-30): `make test` runs them, `make unit` keeps the plain kernels.


@pytest.mark.slow
@pytest.mark.parametrize("window,softcap", WINDOWED)
def test_prefill_with_window_and_softcap_matches_reference_and_naive(window, softcap):
    torch.manual_seed(0)
    dtype, heads, kv_heads, head_dim, block_size = torch.float32, 6, 2, 16, 8
    pool = Pool(kv_heads, head_dim, block_size, dtype)
    chunks = PREFILL_BATCHES["mixed"] + [(70, 155)]
    total = sum(q for q, _ in chunks)
    query = _randn(total, heads, head_dim, dtype=dtype)
    keys, values = _randn(total, kv_heads, head_dim, dtype=dtype), _randn(total, kv_heads, head_dim, dtype=dtype)
    scale = head_dim ** -0.5
    expected, naive = torch.zeros_like(query), torch.zeros_like(query)
    tables, starts, start = [], [], 0
    for query_len, context_len in chunks:
        table = pool.table(context_len)
        rows = slice(start, start + query_len)
        pool.write(keys[rows], values[rows], table, context_len - query_len)
        expected[rows] = ref.prefill_attention_ref(query[rows], keys[rows], values[rows], pool.k, pool.v, table,
                                                   context_len, scale, window, softcap)
        context_k = ref.gather_blocks(pool.k, table)[:, :context_len].transpose(0, 1)
        context_v = ref.gather_blocks(pool.v, table)[:, :context_len].transpose(0, 1)
        naive[rows] = _naive_attention(query[rows], context_k, context_v, range(context_len - query_len, context_len),
                                       scale, window, softcap)
        tables.append(table)
        starts.append(start)
        start += query_len
    torch.testing.assert_close(expected, naive, atol=1e-5, rtol=1e-5)
    out = torch.zeros_like(query)
    query_lens, context_lens = zip(*chunks)
    prefill_attention(query, pool.k, pool.v, _padded(tables), *(torch.tensor(x, device=DEVICE) for x in
                      (starts, query_lens, context_lens)), max(query_lens), scale, out, window=window, softcap=softcap)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    # The last chunk's context (155) is longer than the windows: ignoring the window or the cap would fail.
    if (window or 1000) < 155 or softcap is not None:
        full = ref.prefill_attention_ref(query[rows], keys[rows], values[rows], pool.k, pool.v, table, 155, scale)
        assert not torch.allclose(full, expected[rows], atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("window,softcap", WINDOWED)
# 8: partitions wholly before the window are skipped; strided: 8-key partitions, programs sized for 24-key
# contexts, so each takes every third partition of a longer one (paged_attention.decode_programs)
@pytest.mark.parametrize("partition_size", [None, 16, 8, "8-strided"])
def test_decode_with_window_and_softcap_matches_reference_and_naive(window, softcap, partition_size, monkeypatch):
    if partition_size == "8-strided":
        from kaon_runtime.kernels import paged_attention
        monkeypatch.setattr(paged_attention, "_SIZING_CONTEXT", 24)
        partition_size = 8
    torch.manual_seed(0)
    dtype, heads, kv_heads, head_dim, block_size = torch.float32, 4, 2, 16, 8
    pool = Pool(kv_heads, head_dim, block_size, dtype)
    context_lens = [1, 8, 37, 200]
    tables = [pool.table(n) for n in context_lens]
    padded = _padded(tables)
    lens = torch.tensor(context_lens, device=DEVICE)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long, device=DEVICE),
                             decode_block_tables=padded, decode_context_lens=lens)
    key_mask = TorchAttentionBackend._decode_mask(meta, block_size, window)
    query = _randn(len(context_lens), heads, head_dim, dtype=dtype)
    scale = head_dim ** -0.5
    expected = ref.decode_attention_ref(query, pool.k, pool.v, padded, key_mask, scale, softcap=softcap)
    for i, (n, table) in enumerate(zip(context_lens, tables)):
        context_k = ref.gather_blocks(pool.k, table)[:, :n].transpose(0, 1)
        context_v = ref.gather_blocks(pool.v, table)[:, :n].transpose(0, 1)
        naive = _naive_attention(query[i:i + 1], context_k, context_v, [n - 1], scale, window, softcap)
        torch.testing.assert_close(expected[i:i + 1], naive, atol=1e-5, rtol=1e-5)
    out = torch.zeros_like(query)
    decode_attention(query, pool.k, pool.v, padded, lens, scale, out, partition_size=partition_size, window=window,
                     softcap=softcap)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
