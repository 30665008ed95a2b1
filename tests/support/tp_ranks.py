"""Tensor-parallel ranks on CPU for tests: N spawned processes in one gloo group, each running a function of
its TensorParallel, and what the fused CPU step's tests run in them (a tiny model's shard through the C step
and through torch's path; the rank-order sum on steps of several sizes)."""
from __future__ import annotations

import io
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from kaon_runtime.config import ModelConfig
from kaon_runtime.distributed.parallel import TensorParallel, join_group
from kaon_runtime.distributed.sharding import kv_head_start, local_config
from kaon_runtime.layers.attention import AttentionMetadata, PrefillChunk
from kaon_runtime.layers.kernel_backend import torch_kernels
from kaon_runtime.loader.hf_dir import model_config_from_hf
from kaon_runtime.models.registry import build_model
from kaon_runtime.quant import quantize_model


def run_ranks(fn: Callable[..., Any], size: int, *args: Any, timeout: float = 600) -> list[Any]:
    """fn(tp, *args) on each of `size` ranks (spawned processes, one gloo group); their results by rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    procs = [context.Process(target=_rank_main, args=(fn, rank, size, port, queue, args), daemon=True)
             for rank in range(size)]
    for proc in procs:
        proc.start()
    try:
        results = {rank: torch.load(io.BytesIO(data)) for rank, data in (queue.get(timeout=timeout) for _ in procs)}
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    failed = {rank: r for rank, r in results.items() if isinstance(r, str) and r.startswith("error: ")}
    assert not failed, failed
    return [results[rank] for rank in range(size)]


def _rank_main(fn, rank: int, size: int, port: int, queue, args) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores, as CPU tensor parallelism's workers do
    tp = join_group(rank, size, port, torch.device("cpu"))
    try:
        result = fn(tp, *args)
    except Exception as exc:  # noqa: BLE001 -- reported to the test, which fails with it
        result = f"error: {type(exc).__name__}: {exc}"
    data = io.BytesIO()
    torch.save(result, data)  # as bytes: a tensor put in the queue as it is would be shared by a descriptor of ours
    queue.put((rank, data.getvalue()))
    tp.release()


# ---- the rank-order sum ---------------------------------------------------------------------

def rank_sums(tp: TensorParallel, rows: list[int], hidden: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """This rank's row of partial sums (random, of very different magnitudes), and that row repeated to a step
    of each number of rows and summed over the ranks by sum_in_rank_order."""
    generator = torch.Generator().manual_seed(tp.rank)
    row = torch.randn(hidden, generator=generator) * 10.0 ** torch.randint(-3, 4, (hidden,), generator=generator)
    return row, [tp.sum_in_rank_order(row.repeat(n, 1).contiguous()) for n in rows]


# ---- a tiny model's shard through the C step and through torch's ------------------------------

BLOCK = 4
# Three decoding sequences (their blocks out of order in the pool) and a 7-token prompt in blocks 1 and 4
TABLES, LENS = [[5], [2, 9, 0], [7, 3]], [1, 11, 6]  # (the second step fills the 3 blocks exactly)
PROMPT_TABLE = [1, 4]


def hf_model(family: str, **extra):
    """A tiny random transformers model of `family` (llama, qwen2, gemma2, qwen3_moe): weights spread, seed fixed."""
    import transformers
    classes = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
               "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM)}
    config_cls, model_cls = classes[family]
    torch.manual_seed(0)
    base = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, head_dim=16)
    model = model_cls(config_cls(**{**base, **extra}))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.5) + (0.0 if p.dim() > 1 else 1.0))
    return model


def checkpoint(family: str, extra: dict) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """hf_model(family, **extra) as kaon reads it: its config and its HF-named tensors (made once, by the
    test's process: the ranks need not import transformers)."""
    hf = hf_model(family, **extra)
    config = model_config_from_hf({**hf.config.to_dict(), "architectures": [type(hf).__name__]})
    if config.num_experts:  # transformers holds the experts fused in memory; its checkpoints name them per expert
        import tempfile

        from safetensors.torch import load_file
        with tempfile.TemporaryDirectory() as tmp:
            hf.save_pretrained(tmp, safe_serialization=True)
            return config, load_file(f"{tmp}/model.safetensors")
    return config, {name: t.detach().clone() for name, t in hf.state_dict().items()}


def shard_outputs(tp: TensorParallel, config: ModelConfig, tensors: dict[str, torch.Tensor],
                  cpu_decode: bool, quantization: str = "none") -> dict[str, torch.Tensor]:
    """This rank's shard of a checkpoint, its KV pool its share of one random pool: the final hidden states of a
    decode step (TABLES, LENS), then of the prompt's 7 rows in one chunk beside those decodes (the decodes'
    second step), through the fused C step (`cpu_decode`) or torch's path. Under a `quantization` (int8, int4,
    fp8) the rank's float shard is quantized as the engine quantizes it (quant.quantize_model after the load), and
    through the C step the prompt's rows are also computed alone (a prompt-only step, "alone") and in two chunks
    of 3 and 4 rows ("chunked"), the second reading the keys the first wrote."""
    model = build_model(config, tp, torch_kernels(cpu_decode)).float()
    model.load_weights(tensors.items())
    if quantization != "none":
        quantize_model(model, quantization)
    model.eval()
    local = local_config(config, tp.size)
    torch.manual_seed(5)
    pool = torch.randn(config.num_layers, 2, config.num_kv_heads, 10, BLOCK, config.head_dim)
    start = kv_head_start(config.num_kv_heads, tp.rank, tp.size)
    cache = pool[:, :, start:start + local.num_kv_heads].clone()
    for i, attn in enumerate(model.attention_layers()):
        attn.k_cache, attn.v_cache = cache[i, 0], cache[i, 1]
    if cpu_decode:
        model.check_kernels()
        assert model.model.cpu_decode is not None and model.model.cpu_decode.tp is (tp if tp.size > 1 else None)
    else:
        assert model.model.cpu_decode is None
    torch.manual_seed(6)
    x = torch.randn(len(LENS) + 7, config.hidden_size)
    with torch.inference_mode():
        decode = model.model(x[:3].clone(), *_decode_rows(LENS))
        positions, meta = _decode_rows([n + 1 for n in LENS])
        chunk = PrefillChunk(query_start=3, query_len=7, context_len=7, block_table=torch.tensor(PROMPT_TABLE))
        prompt_slots = torch.tensor([PROMPT_TABLE[i // BLOCK] * BLOCK + i % BLOCK for i in range(7)])
        meta.slot_mapping = torch.cat([meta.slot_mapping, prompt_slots])
        meta.prefills = [chunk]
        mixed = model.model(x.clone(), torch.cat([positions, torch.arange(7)]), meta)
        if quantization == "none" or not cpu_decode:
            return {"decode": decode, "mixed": mixed}
        # The prompt again (its keys rewritten to the same values): alone, then in two chunks
        alone = model.model(x[3:].clone(), torch.arange(7), _prompt_rows(0, 7, prompt_slots))
        first = model.model(x[3:6].clone(), torch.arange(3), _prompt_rows(0, 3, prompt_slots))
        second = model.model(x[6:].clone(), torch.arange(3, 7), _prompt_rows(3, 7, prompt_slots))
    return {"decode": decode, "mixed": mixed, "alone": alone, "chunked": torch.cat([first, second])}


def _prompt_rows(start: int, end: int, slots: torch.Tensor) -> AttentionMetadata:
    """A prompt-only step of the prompt's rows start..end (in PROMPT_TABLE's blocks), seeing its rows before them."""
    chunk = PrefillChunk(query_start=0, query_len=end - start, context_len=end,
                         block_table=torch.tensor(PROMPT_TABLE[:-(-end // BLOCK)]))
    return AttentionMetadata(slot_mapping=slots[start:end], prefills=[chunk])


def _decode_rows(lens: list[int]) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions and metadata of a decode step of the TABLES sequences at these lengths (each newest token at
    position len - 1, its key and value to that position's slot)."""
    widest = max(map(len, TABLES))
    slots = torch.tensor([t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for t, n in zip(TABLES, lens)])
    meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=len(lens),
                             decode_block_tables=torch.tensor([t + [0] * (widest - len(t)) for t in TABLES]),
                             decode_context_lens=torch.tensor(lens))
    return torch.tensor([n - 1 for n in lens]), meta


def all_shard_outputs(tp: TensorParallel, checkpoints: dict[str, tuple[ModelConfig, dict]],
                      quantizations: dict[str, str] | None = None) -> dict[str, dict]:
    """shard_outputs of every checkpoint (see `checkpoint`), through the C step and through torch's path, each
    under its quantization (`quantizations`, by checkpoint name; none where it is not named)."""
    quantizations = quantizations or {}
    return {name: {path: shard_outputs(tp, config, tensors, path == "c", quantizations.get(name, "none"))
                   for path in ("c", "torch")}
            for name, (config, tensors) in checkpoints.items()}
