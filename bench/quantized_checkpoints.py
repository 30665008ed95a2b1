"""CPU decode of GPTQ checkpoints against kaon's own int4, in one run.

    python bench/quantized_checkpoints.py [--groups 32 64] [--tokens 64] [--repeats 3]

The bundled SmolLM2-135M-Instruct (a Q4_1 GGUF, dequantized) is written as GPTQ directories
(round-to-nearest, asymmetric, AutoGPTQ's v1 layout, packed here with numpy) with each group size
in --groups. kaon loads each kept quantized (groups wider than 32 split into 32 for the fused CPU
step) and is timed against kaon's int4 on the GGUF itself (its own Q4_1 blocks, groups of 32).
Batch-1 decode tokens/s after a short prompt, prefill excluded, median of repeats; the last column
is how many greedy tokens each shares with float32 on the GGUF before the first that differs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))

MODEL = "builtin://smollm2-135m-instruct"
PROMPT = "The river kept its own calendar. In spring it ran brown and fast with snowmelt, and in summer"
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def pack_words(q: np.ndarray) -> np.ndarray:
    """4-bit values [R, C] -> int32 [R / 8, C], value i of a word at bits 4i (GPTQ's packing along rows)."""
    words = np.zeros((q.shape[0] // 8, q.shape[1]), dtype=np.uint32)
    for i in range(8):
        words |= q[i::8].astype(np.uint32) << np.uint32(4 * i)
    return words.view(np.int32)


def gptq_tensors(w: np.ndarray, group: int) -> dict[str, np.ndarray]:
    """Round-to-nearest asymmetric 4-bit of float [N, K] in groups along K, in GPTQ v1's tensors."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = np.minimum(g.min(-1), 0), np.maximum(g.max(-1), 0)
    scales = ((hi - lo) / 15).astype(np.float16)
    s = np.maximum(scales.astype(np.float32), 1e-8)
    zeros = np.clip(np.round(-lo / s), 0, 15).astype(np.int64)
    q = np.clip(np.round(g / s[..., None]) + zeros[..., None], 0, 15).reshape(n, k).astype(np.int64)
    # qzeros [G, N / 8] is packed along N and stores zero - 1 (AutoGPTQ's v1 convention).
    return {"qweight": pack_words(q.T), "qzeros": pack_words((zeros - 1) & 15).T.copy(), "scales": scales.T.copy(),
            "g_idx": (np.arange(k) // group).astype(np.int32)}


def write_gptq(directory: Path, group: int) -> None:
    import torch
    from safetensors.torch import save_file

    from kaon_runtime.loader import open_checkpoint

    checkpoint = open_checkpoint(MODEL)
    c = checkpoint.config
    state = {}
    for name, tensor in checkpoint.weights():
        module, _, kind = name.rpartition(".")
        if module.rpartition(".")[2] in LINEARS and kind == "weight":
            for suffix, array in gptq_tensors(tensor.float().numpy(), group).items():
                state[f"{module}.{suffix}"] = torch.from_numpy(np.ascontiguousarray(array))
        else:
            state[name] = tensor.contiguous()
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    config = dict(architectures=["LlamaForCausalLM"], vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                  intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
                  num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                  max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                  rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings,
                  quantization_config=dict(quant_method="gptq", bits=4, group_size=group, desc_act=False, sym=False))
    (directory / "config.json").write_text(json.dumps(config))
    checkpoint.tokenizer.backend.save(str(directory / "tokenizer.json"))
    tokenizer = checkpoint.tokenizer
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": tokenizer.backend.id_to_token(tokenizer.bos_token_id) if tokenizer.bos_token_id is not None
        else None, "eos_token": tokenizer.backend.id_to_token(tokenizer.eos_token_ids[0])}))


def rate(llm, tokens: int, repeats: int) -> float:
    from kaon_runtime import SamplingParams

    def run(n: int) -> None:
        llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)

    run(2)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run(1)
        t1 = time.perf_counter()
        run(1 + tokens)
        t2 = time.perf_counter()
        rates.append(tokens / ((t2 - t1) - (t1 - t0)))
    return statistics.median(rates)


def greedy(llm, tokens: int) -> list[int]:
    from kaon_runtime import SamplingParams
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    return out[0].outputs[0].token_ids


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import torch

    from kaon_runtime import LLM

    reference = greedy(LLM(MODEL, device="cpu", show_progress=False), args.tokens)
    rows = []
    own = LLM(MODEL, device="cpu", show_progress=False, quantization="int4")
    own_rate = rate(own, args.tokens, args.repeats)
    rows.append(("kaon int4 (GGUF Q4_1 blocks)", own_rate, greedy(own, args.tokens)))
    del own
    with tempfile.TemporaryDirectory() as tmp:
        for group in args.groups:
            directory = Path(tmp) / f"gptq-g{group}"
            directory.mkdir()
            write_gptq(directory, group)
            llm = LLM(str(directory), device="cpu", show_progress=False)
            rows.append((f"GPTQ 4-bit, groups of {group}", rate(llm, args.tokens, args.repeats),
                         greedy(llm, args.tokens)))
            del llm
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; batch-1 decode, {args.tokens} tokens")
    print(f"{'format':34} {'tok/s':>8} {'vs int4':>8} {'same as float32':>16}")
    for name, tokens_per_s, tokens in rows:
        same = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), len(reference))
        print(f"{name:34} {tokens_per_s:8.1f} {tokens_per_s / own_rate:7.2f}x {same:>10}/{len(reference)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
