"""Triton paged attention over the head-major cache: prefill chunks and split-KV decode.

References: paged_attention_ref.prefill_attention_ref and decode_attention_ref. Both kernels
read every key, the step's own included, from the cache, so the step's K/V must be written
first (kv_cache.write_kv_cache, or rotary.rotary_write_kv). Softmax is online (running max and sum, base 2) in float32.

Prefill: one program per (block of BLOCK_M query rows, chunk, query head); chunks have
different lengths, so programs past a chunk's end return at once. Decode: programs per
(sequence, kv head) each taking one partition of the context, or every so many past an 8K
context (decode_programs); the query heads sharing the kv head are the rows of one tile, so
each key is read once per group. When the batch alone cannot fill the
GPU, long contexts are cut into partitions; the last partition of a sequence to finish merges
the partial results (an arrival counter per sequence and kv head), so decode is one launch
whatever the split, and a sequence whose window one partition covers writes its output directly.

Sliding windows: a query at position p sees keys p - window + 1 .. p; loops start at the
oldest key any row of the program can see, and decode partitions wholly before the window
do nothing (and are not waited for). Soft-capping (Gemma 2) turns each score s into
cap * tanh(s / cap) before the softmax.

Over 300 lines: both kernels share _attend, and the decode's in-launch merge belongs beside it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kaon_runtime.kernels.paged_attention_ref import MAX_HEAD_SLICE

# Tile sizes (prefill query rows per program, keys per inner-loop step). Compiled for sm_90
# (tests/unit/runtime/kernels/test_kernels_compile.py), float32 at 64 x 64 spilled 30 KB per program in prefill:
# its exact products run on the CUDA cores and hold twice the bytes, so its tiles are halved.
_TILES = {torch.float16: (64, 64), torch.bfloat16: (64, 64), torch.float32: (32, 32)}
# 8 warps: 128 registers per thread instead of 234 at 4 (bf16, sm_90), twice the warps per SM.
_PREFILL_WARPS = 8
_MIN_DOT = 16  # tl.dot wants every dimension >= 16; decode pads its head group up to it
_MIN_PARTITION = 256  # a shorter partition saves less than the merge costs
_SIZING_CONTEXT = 8192  # contexts partitions are sized for (see partition_size)
_MERGE_TILE = 16  # partitions merged per step: long contexts can have hundreds
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634
_NO_WINDOW = 1 << 30  # a window no context reaches: full causal attention, without a second code path


@triton.jit
def _attend(q, query_pos, k_base, v_base, table_ptr, start, end, qk_scale, window, cap_log2e, m_i, l_i, acc,
            BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    """Fold keys [start, end) into the running (max, sum, output) of the rows of q.

    Row r only sees keys at positions query_pos[r] - window < key <= query_pos[r]. Without
    SOFTCAP, qk_scale is the softmax scale times log2(e); with it, scale / cap, and cap_log2e
    is cap * log2(e). A row can have no visible key in a tile (its window starts later):
    its max stays -inf and it gains nothing from the tile.
    """
    dims = tl.arange(0, BLOCK_D)
    for tile in range(start, end, BLOCK_N):
        keys = tile + tl.arange(0, BLOCK_N)
        in_range = keys < end
        # int32 offsets within one head's slice of the pool (launchers check it fits), so the
        # [keys, head_dim] offset tiles of K and V take 32-bit registers, not 64-bit ones.
        blocks = tl.load(table_ptr + keys // BLOCK_SIZE, mask=in_range, other=0).to(tl.int32)
        rows = blocks * (BLOCK_SIZE * HEAD_DIM) + ((keys % BLOCK_SIZE) * HEAD_DIM).to(tl.int32)
        mask = in_range[:, None] & (dims[None, :] < HEAD_DIM)
        k = tl.load(k_base + rows[:, None] + dims[None, :], mask=mask, other=0.0)
        v = tl.load(v_base + rows[:, None] + dims[None, :], mask=mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if SOFTCAP:
            scores = (2 * tl.sigmoid(2 * scores) - 1) * cap_log2e  # tanh(x) = 2 sigmoid(2x) - 1
        visible = (in_range[None, :] & (keys[None, :] <= query_pos[:, None])
                   & (keys[None, :] > query_pos[:, None] - window))
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet: exp2(-inf) = 0, not NaN
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _prefill_kernel(q_ptr, out_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, query_starts_ptr, query_lens_ptr,
                    context_lens_ptr, qk_scale, window, cap_log2e, stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_ch, stride_table,
                    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
                    INVARIANT: tl.constexpr):
    q_block, chunk, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    query_len = tl.load(query_lens_ptr + chunk).to(tl.int32)
    if q_block * BLOCK_M >= query_len:
        return
    query_start = tl.load(query_starts_ptr + chunk).to(tl.int32)
    context_len = tl.load(context_lens_ptr + chunk).to(tl.int32)
    rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < query_len) & (dims[None, :] < HEAD_DIM)
    tokens = (query_start + rows)[:, None]
    q = tl.load(q_ptr + tokens * stride_qt + head * stride_qh + dims[None, :], mask=mask, other=0.0)
    # The chunk holds the last query_len positions of its context (bottom-right causal alignment).
    first_pos = context_len - query_len
    query_pos = first_pos + rows
    end = tl.minimum(context_len, first_pos + (q_block + 1) * BLOCK_M)  # nothing later is visible
    start = tl.maximum(first_pos + q_block * BLOCK_M - window + 1, 0)  # nor anything older than the first row's window
    if INVARIANT:  # key tiles at multiples of BLOCK_N whatever the chunk: see prefill_attention
        start = start // BLOCK_N * BLOCK_N
    kv_offset = (head // GROUP).to(tl.int64) * stride_ch
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m_i, l_i, acc = _attend(q, query_pos, k_cache_ptr + kv_offset, v_cache_ptr + kv_offset,
                            tables_ptr + chunk * stride_table, start, end, qk_scale, window, cap_log2e, m_i, l_i,
                            acc, BLOCK_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D, PRECISION, SOFTCAP)
    out = acc / tl.where(l_i == 0, 1.0, l_i)[:, None]  # rows past the chunk may see no key; they are not stored
    tl.store(out_ptr + tokens * stride_ot + head * stride_oh + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _decode_kernel(q_ptr, out_ptr, partial_ptr, lse_ptr, counter_ptr, k_cache_ptr, v_cache_ptr, tables_ptr,
                   context_lens_ptr, qk_scale, window, cap_log2e, partition_size, num_heads, max_parts,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_ch, stride_table,
                   GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, SPLIT: tl.constexpr,
                   PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    seq, kv_head, program = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    programs = tl.num_programs(2)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    # The partitions holding keys of this sequence's window; program p takes first + p, + programs, ...
    # (a grid sized for common contexts, not for the table width: few programs return at once).
    used = tl.cdiv(context_len, partition_size)
    first = tl.maximum(context_len - window, 0) // partition_size
    if first + program >= used:
        return
    group = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + group
    dims = tl.arange(0, BLOCK_D)
    mask = (group[:, None] < GROUP) & (dims[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=mask, other=0.0)
    query_pos = context_len - 1 + tl.zeros([BLOCK_G], tl.int32)  # the newest token sees its whole context
    kv_offset = kv_head.to(tl.int64) * stride_ch
    out_rows = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    for part in range(first + program, used, programs):
        start = tl.maximum(part * partition_size, context_len - window)  # keys older than the window: never seen
        end = tl.minimum(context_len, (part + 1) * partition_size)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        m_i, l_i, acc = _attend(q, query_pos, k_cache_ptr + kv_offset, v_cache_ptr + kv_offset,
                                tables_ptr + seq * stride_table, start, end, qk_scale, window, cap_log2e, m_i, l_i,
                                acc, BLOCK_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D, PRECISION, SOFTCAP)
        out = acc / l_i[:, None]
        if not SPLIT:
            tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=mask)
        elif used - first == 1:
            # The only partition: its output is final, with the bits a merge of one would give (weight exp2(0)).
            tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            # Partial output and log-sum-exp (base 2), rows (seq, head) of [S, H, max_parts(, D)] buffers.
            rows = (seq * num_heads + heads) * max_parts + part
            tl.store(partial_ptr + rows[:, None] * HEAD_DIM + dims[None, :], out, mask=mask)
            tl.store(lse_ptr + rows, m_i + tl.log2(l_i), mask=group < GROUP)
    if SPLIT:  # a compile-time test: non-split launches carry no atomics  # noqa: SIM102
        if used - first > 1:
            _merge_if_last(partial_ptr, lse_ptr, counter_ptr + seq * tl.num_programs(1) + kv_head, out_ptr,
                           tl.cdiv(used - first - program, programs), used - first, seq, kv_head, first, used,
                           num_heads, max_parts, stride_ot, stride_oh, GROUP, HEAD_DIM, BLOCK_D, BLOCK_P)


@triton.jit
def _merge_if_last(partial_ptr, lse_ptr, counter, out_ptr, done, working, seq, kv_head, first, used, num_heads,
                   max_parts, stride_ot, stride_oh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr):
    """Count this program's `done` partitions in; the program that completes the sequence's `working` ones
    merges them all, so no second launch is needed whatever the context: under CUDA graphs the contexts
    grow while the captured launch stays the same. Split-K's semaphore pattern: every thread's stores,
    a barrier, then one acquire-release atomic; the merging program zeroes the counter for the next launch."""
    tl.debug_barrier()
    if tl.atomic_add(counter, done, sem="acq_rel", scope="gpu") + done == working:
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
        dims = tl.arange(0, BLOCK_D)
        for g in tl.static_range(GROUP):
            row = (seq * num_heads + kv_head * GROUP + g) * max_parts
            merged = _merge_head(partial_ptr, lse_ptr, row, first, used, HEAD_DIM, BLOCK_P, BLOCK_D)
            tl.store(out_ptr + seq * stride_ot + (kv_head * GROUP + g) * stride_oh + dims,
                     merged.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


@triton.jit
def _merge_head(partial_ptr, lse_ptr, row, first, used, HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """One head's output from its partitions first .. used - 1 (row: its first partition's index).

    Loads bypass L1 (.cg): the partials were written by other programs, possibly on other SMs."""
    dims = tl.arange(0, BLOCK_D)
    # Running max (shape [1], to broadcast) and weighted sums over tiles of partitions, as in the softmax itself.
    m = tl.full([1], float("-inf"), tl.float32)
    total = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for tile in range(first, used, BLOCK_P):
        parts = tile + tl.arange(0, BLOCK_P)
        lse = tl.load(lse_ptr + row + parts, mask=parts < used, other=float("-inf"), cache_modifier=".cg")
        partial = tl.load(partial_ptr + (row + parts)[:, None] * HEAD_DIM + dims[None, :],
                          mask=(parts[:, None] < used) & (dims[None, :] < HEAD_DIM), other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, 0))
        rescale = tl.exp2(m - m_new)
        weights = tl.exp2(lse - m_new)
        acc = acc * rescale + tl.sum(partial * weights[:, None], 0)
        total = total * rescale + tl.sum(weights, 0)
        m = m_new
    return acc / total


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      query_starts: torch.Tensor, query_lens: torch.Tensor, context_lens: torch.Tensor,
                      max_query_len: int, scale: float, out: torch.Tensor, window: int | None = None,
                      softcap: float | None = None, invariant: bool = False) -> None:
    """Causal attention of P prefill chunks over their cached contexts, written into `out`.

    query and out [T, H, D] are the whole flattened batch; chunk i owns rows
    query_starts[i] .. + query_lens[i], the last query_lens[i] positions of a context of
    context_lens[i] tokens held in the blocks of block_tables[i] ([P, M], padded).
    window: sliding window (None: full causal); softcap: tanh soft-capping of the scores.

    invariant (issue 49 §2, KAON_GPU_BATCH_INVARIANT): a row's output does not depend on its chunk's
    start or length, the query tile it lands in, or the other chunks. Without a window that holds
    as is: tiles are fixed per dtype, every row folds the key tiles [0, BLOCK_N), [BLOCK_N, 2 BLOCK_N), ...
    in order, and the keys a row cannot see (past it, or tiles past its own) add exact zeros. With a
    window the first tile would start at the tile's first row's window; `invariant` starts it at a
    multiple of BLOCK_N instead (the keys before a row's window add exact zeros too). The rows of one
    tl.dot are computed alike whatever the other rows hold, so a decode row, run as a chunk of one
    (layers.attention), gets the bits it would get inside a longer chunk.
    """
    _check_common(query, k_cache, v_cache, out)
    chunks = block_tables.shape[0]
    assert query_starts.shape == query_lens.shape == context_lens.shape == (chunks,)
    assert query_starts.is_contiguous() and query_lens.is_contiguous() and context_lens.is_contiguous()
    assert block_tables.stride(1) == 1, "block table rows must be contiguous"
    if chunks == 0:
        return
    heads, dim = query.shape[1], query.shape[2]
    block_m, block_n = _TILES[query.dtype]
    grid = (triton.cdiv(max_query_len, block_m), chunks, heads)
    _prefill_kernel[grid](
        query, out, k_cache, v_cache, block_tables, query_starts, query_lens, context_lens,
        *_score_args(scale, window, softcap), query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), block_tables.stride(0),
        GROUP=heads // k_cache.shape[0], BLOCK_SIZE=k_cache.shape[2], HEAD_DIM=dim, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(dim), PRECISION=_precision(query.dtype),
        SOFTCAP=softcap is not None, INVARIANT=invariant, num_warps=_PREFILL_WARPS)


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, out: torch.Tensor,
                     partition_size: int | None = None, window: int | None = None,
                     softcap: float | None = None) -> None:
    """One query token per sequence against its whole cached context, written into `out`.

    query and out [S, H, D]; block_tables [S, M] (padding never read); context_lens [S].
    partition_size: keys per program; None picks it so that the grid fills the GPU, and
    a size below the longest context (M * block_size) splits the work and merges.
    window and softcap as in prefill_attention.
    """
    _check_common(query, k_cache, v_cache, out)
    seqs, heads, dim = query.shape
    kv_heads, _, block_size, _ = k_cache.shape
    assert block_tables.shape[0] == seqs and context_lens.shape == (seqs,) and context_lens.is_contiguous()
    assert block_tables.stride(1) == 1, "block table rows must be contiguous"
    if seqs == 0:
        return
    max_len = block_tables.shape[1] * block_size  # from the shape: no device sync to learn the longest context
    if partition_size is None:
        partition_size = _auto_partition(seqs * kv_heads, max_len, query.device)
    assert partition_size > 0
    num_parts = triton.cdiv(max_len, partition_size)
    group = heads // kv_heads
    meta = dict(GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=dim, BLOCK_G=max(_MIN_DOT, triton.next_power_of_2(group)),
                BLOCK_N=_TILES[query.dtype][1], BLOCK_D=triton.next_power_of_2(dim), PRECISION=_precision(query.dtype),
                SOFTCAP=softcap is not None)
    qk_scale, window, cap_log2e = _score_args(scale, window, softcap)
    if num_parts == 1:
        partial = lse = counters = out  # stand-ins the kernel never reads
    else:
        partial = torch.empty(seqs, heads, num_parts, dim, dtype=torch.float32, device=query.device)
        lse = torch.empty(seqs, heads, num_parts, dtype=torch.float32, device=query.device)
        counters = _counters(seqs * kv_heads, query.device)
    _decode_kernel[(seqs, kv_heads, decode_programs(num_parts, partition_size, max_len))](
        query, out, partial, lse, counters, k_cache, v_cache, block_tables, context_lens, qk_scale, window, cap_log2e,
        partition_size, heads, num_parts, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), block_tables.stride(0), SPLIT=num_parts > 1,
        BLOCK_P=min(_MERGE_TILE, triton.next_power_of_2(num_parts)), **meta)


# Per device: one arrival counter per (sequence, kv head) for split decodes, zero between launches (the
# merging program zeroes its own). Kept, not allocated per call: a fresh buffer would need a zeroing launch.
# Launches on one device are assumed ordered (one stream), as the engine runs them.
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_MIN_COUNTERS = 4096  # 512 sequences x 8 kv heads: allocated before any CUDA graph is captured, in practice


def _counters(needed: int, device: torch.device) -> torch.Tensor:
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < needed:
        counters = torch.zeros(triton.next_power_of_2(max(needed, _MIN_COUNTERS)), dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters


def _score_args(scale: float, window: int | None, softcap: float | None) -> tuple[float, int, float]:
    """qk_scale, window and cap_log2e as the kernels take them (see _attend)."""
    assert window is None or window >= 1, f"a sliding window holds at least the query itself, got {window}"
    window = _NO_WINDOW if window is None else window
    if softcap is None:
        return scale * _LOG2E, window, 0.0
    return scale / softcap, window, softcap * _LOG2E


def _check_common(query, k_cache, v_cache, out) -> None:
    assert query.dim() == 3 and out.shape == query.shape, "query and out are [tokens, heads, head_dim]"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "caches are [kv_heads, blocks, block_size, head_dim]"
    assert query.dtype == out.dtype == k_cache.dtype == v_cache.dtype and query.dtype in _DTYPES
    assert query.shape[2] == k_cache.shape[3] >= _MIN_DOT, "head_dim must match the cache and be >= 16"
    assert query.shape[1] % k_cache.shape[0] == 0, "query heads must be a multiple of kv heads"
    assert query.stride(2) == 1 and out.stride(2) == 1, "head_dim must be contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.stride(0) <= MAX_HEAD_SLICE, "a kv head's slice of the pool must fit int32 offsets"


def _precision(dtype: torch.dtype) -> str:
    # float32 models expect float32 products, not TF32's 10-bit mantissa; half types ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


def _auto_partition(programs: int, max_len: int, device: torch.device) -> int:
    if device.type != "cuda":
        return max_len  # the interpreter runs programs one by one: splitting only adds work
    return partition_size(programs, max_len, torch.cuda.get_device_properties(device).multi_processor_count)


def decode_programs(num_parts: int, partition_size: int, max_len: int) -> int:
    """Programs per (sequence, kv head): one per partition of a context up to _SIZING_CONTEXT (the
    contexts partition_size fills the GPU at), each taking every so many partitions past it. Sized by
    the table width, a CUDA graph's 128K tables launched 512 per head, all but a few returning at once."""
    return min(num_parts, triton.cdiv(min(max_len, _SIZING_CONTEXT), partition_size))


def partition_size(programs: int, max_len: int, num_sms: int) -> int:
    """Keys per decode program: split contexts until there are about two programs per SM.

    Sized for contexts up to _SIZING_CONTEXT even when the block tables are wider: under CUDA
    graphs they are as wide as the longest context allowed (128K for Llama 3.1), and sizing by
    that would give one huge partition per program, leaving most SMs idle on common contexts.
    Partitions past a sequence's end cost a program that returns at once.
    """
    splits = triton.cdiv(2 * num_sms, programs)
    return max(_MIN_PARTITION, triton.next_power_of_2(triton.cdiv(min(max_len, _SIZING_CONTEXT), splits)))
