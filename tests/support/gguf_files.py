"""Tiny Llama GGUF files in any GGML type, written by the gguf package (GGUFWriter), with the
bundled SmolLM2 file's tokenizer. Types gguf can quantize (Q4_0..Q8_0) are quantized from random
float weights by gguf.quants.quantize; the K-quants, which it can only read, are random blocks
to ggml's layout with float16 super-block scales chosen so the weights stay small."""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2  # K-quants need K a multiple of 256
# GGML type -> ((offset of each float16 super-block scale), its typical size): weights of ~0.05
_K_SCALES = {"Q2_K": ((80, 82), 3e-3), "Q3_K": ((108,), 6e-4), "Q4_K": ((0, 2), 1.5e-4),
             "Q5_K": ((0, 2), 8e-5), "Q6_K": ((208,), 4e-5)}
# Q4_K_M as llama.cpp mixes it: Q4_K, with Q6_K for attn_v and ffn_down (here in every layer)
MIXES = {"Q4_K_M": [("Q4_K", {"attn_v": "Q6_K", "ffn_down": "Q6_K"})] * LAYERS,
         "Q5_K_M": [("Q5_K", {"attn_v": "Q6_K", "ffn_down": "Q6_K"})] * LAYERS,
         # every type kaon keeps, one layer each, and fused projections of mixed types
         "ALL": [("Q4_K", {"attn_v": "Q6_K", "ffn_down": "Q6_K"}), ("Q4_0", {"attn_k": "Q4_K", "ffn_up": "Q4_1"}),
                 *((t, {}) for t in ("Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q5_K"))]}


def quantized_blocks(gguf, type_name: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, bytes per row] of `type_name`."""
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name not in _K_SCALES:
        return np.asarray(gguf.quants.quantize((rng.standard_normal((rows, k)) * 0.05).astype(np.float32), qtype))
    elements, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, k // elements, size), dtype=np.uint8)
    offsets, typical = _K_SCALES[type_name]
    for at in offsets:
        scale = (typical * (0.5 + rng.random((rows, k // elements)))).astype(np.float16)
        blocks[..., at:at + 2] = scale[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


@functools.lru_cache(maxsize=4)
def tokenizer_fields(source: Path) -> tuple[tuple[str, object, object, object], ...]:
    """The tokenizer.* fields of the GGUF file `source` as (key, contents, type, array item type), read once
    per process: gguf's reader parses the bundled file's 49k tokens and merges value by value (~3.5 s of
    CPU on a Zen 2), which every tiny file written from it paid again. The writer only reads them."""
    import gguf

    fields = []
    for key, field in gguf.GGUFReader(str(source)).fields.items():
        if key.startswith("tokenizer."):
            fields.append((key, field.contents(), field.types[0], field.types[1] if len(field.types) > 1 else None))
    return tuple(fields)


def write_tiny_gguf(path: Path, source: Path, type_name: str, seed: int = 0,
                    truncate_last: bool = False, arch: str = "llama") -> Path:
    """A small Llama whose projections are `type_name` (or a MIXES name: types per layer), norms float32 and
    token embedding float16, tokenizer copied from `source`; truncate_last cuts the file inside
    its last tensor. arch "qwen3" adds its q/k norms."""
    import gguf

    rng = np.random.default_rng(seed)
    # transformers reads no head size from a qwen3 GGUF and takes its default, 128
    heads, kv_heads = (2, 1) if arch == "qwen3" else (HEADS, KV_HEADS)
    plan = MIXES.get(type_name, [(type_name, {})] * LAYERS)
    tokenizer = tokenizer_fields(Path(source))
    writer = gguf.GGUFWriter(str(path), arch)
    vocab = next(len(contents) for key, contents, _, _ in tokenizer if key == "tokenizer.ggml.tokens")
    writer.add_block_count(len(plan))
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_key_length(HIDDEN // heads)
    writer.add_value_length(HIDDEN // heads)
    for key, contents, value_type, sub in tokenizer:
        writer.add_key_value(key, contents, value_type, sub)

    def linear(name: str, rows: int, k: int) -> None:
        layer, part = int(name.split(".")[1]), name.split(".")[2]
        kind = plan[layer][1].get(part, plan[layer][0])
        data = quantized_blocks(gguf, kind, rows, k, rng)
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind])

    writer.add_tensor("token_embd.weight", (rng.standard_normal((vocab, HIDDEN)) * 0.5).astype(np.float16))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    head_dim = HIDDEN // heads
    for i in range(len(plan)):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        if arch == "qwen3":
            for norm in ("attn_q_norm", "attn_k_norm"):
                weight = (1 + 0.1 * rng.standard_normal(head_dim)).astype(np.float32)
                writer.add_tensor(f"blk.{i}.{norm}.weight", weight)
        linear(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        linear(f"blk.{i}.attn_k.weight", kv_heads * head_dim, HIDDEN)
        linear(f"blk.{i}.attn_v.weight", kv_heads * head_dim, HIDDEN)
        linear(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        linear(f"blk.{i}.ffn_gate.weight", INTERMEDIATE, HIDDEN)
        linear(f"blk.{i}.ffn_up.weight", INTERMEDIATE, HIDDEN)
        linear(f"blk.{i}.ffn_down.weight", HIDDEN, INTERMEDIATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if truncate_last:
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size - 100)
    return path
