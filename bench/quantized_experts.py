"""CPU decode of a GPTQ mixture-of-experts checkpoint, experts kept quantized, against the same weights in float32.

    python bench/quantized_experts.py [--tokens 32] [--repeats 3] [--experts 16] [--layers 4]

A random Qwen3-MoE (transformers' own model, saved by save_pretrained with per-expert names; hidden 512,
experts 768 wide, top-2; the bundled SmolLM2 vocabulary) is written as a GPTQ 4-bit directory (round-to-
nearest, asymmetric, groups of 32, AutoGPTQ's v1 layout: every projection and expert, not the router), and
as a float32 directory of the same weights dequantized (the reference, kaon's torch MoE path). kaon loads
both on CPU: weight memory, batch-1 decode tokens/s (prefill excluded, median of repeats) and how many
greedy tokens the quantized run shares with the float one.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))
sys.path.insert(0, str(ROOT / "bench"))

from quantized_checkpoints import MODEL, gptq_tensors, greedy, rate  # noqa: E402

GROUP = 32


def dequantize(w: np.ndarray) -> np.ndarray:
    """What gptq_tensors' round-to-nearest keeps of float [N, K]: (q - zero) * scale per group."""
    n, k = w.shape
    g = w.reshape(n, k // GROUP, GROUP)
    lo, hi = np.minimum(g.min(-1), 0), np.maximum(g.max(-1), 0)
    s = np.maximum(((hi - lo) / 15).astype(np.float16).astype(np.float32), 1e-8)
    zeros = np.clip(np.round(-lo / s), 0, 15)
    q = np.clip(np.round(g / s[..., None]) + zeros[..., None], 0, 15)
    return ((q - zeros[..., None]) * s[..., None]).reshape(n, k).astype(np.float32)


def write_dirs(root: Path, experts: int, layers: int) -> tuple[Path, Path]:
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    from kaon_runtime.loader import open_checkpoint

    tokenizer = open_checkpoint(MODEL).tokenizer
    config = transformers.Qwen3MoeConfig(
        vocab_size=49152, hidden_size=512, intermediate_size=1536, moe_intermediate_size=768, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=experts, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    quantized, reference = root / "gptq", root / "float32"
    model.save_pretrained(quantized)
    state = load_file(quantized / "model.safetensors")
    packed, dense = {}, {}
    for name, tensor in state.items():
        linear = name.startswith("model.layers.") and name.endswith(".weight") and tensor.dim() == 2 \
            and not name.endswith(".mlp.gate.weight")
        if linear:
            w = tensor.float().numpy()
            for suffix, array in gptq_tensors(w, GROUP).items():
                packed[f"{name.removesuffix('.weight')}.{suffix}"] = torch.from_numpy(np.ascontiguousarray(array))
            dense[name] = torch.from_numpy(dequantize(w))
        else:
            packed[name] = dense[name] = tensor.contiguous()
    reference.mkdir()
    for directory, tensors in ((quantized, packed), (reference, dense)):
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
        fields = json.loads((quantized / "config.json").read_text())
        fields.pop("quantization_config", None)
        if directory == quantized:
            fields["quantization_config"] = dict(quant_method="gptq", bits=4, group_size=GROUP, desc_act=False,
                                                 sym=False)
        (directory / "config.json").write_text(json.dumps(fields))
        tokenizer.backend.save(str(directory / "tokenizer.json"))
        (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>",
                                                                     "eos_token": "<|im_end|>"}))
    return quantized, reference


def experts_bytes(model) -> int:
    """Bytes held by the MoE layers' experts (their router left out)."""
    from kaon_runtime.layers.moe import SparseMoE

    return sum(t.numel() * t.element_size() for moe in model.modules() if isinstance(moe, SparseMoE)
               for name, t in [*moe.named_parameters(), *moe.named_buffers()] if not name.startswith("gate."))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    import torch

    from kaon_runtime import LLM

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        quantized, reference = write_dirs(Path(tmp), args.experts, args.layers)
        for label, directory in (("float32 (dequantized weights)", reference), ("GPTQ 4-bit g32, kept", quantized)):
            # dtype auto (float32 activations on CPU) with kaon's fast kernels: `dtype="float32"` on the quantized
            # directory would be its reference arithmetic (quant/reference.py), not what serving runs.
            llm = LLM(str(directory), device="cpu", dtype="auto", show_progress=False)
            rows.append((label, llm.engine.runner.weight_bytes, experts_bytes(llm.engine.runner.model),
                         rate(llm, args.tokens, args.repeats), greedy(llm, args.tokens)))
            del llm
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; Qwen3-MoE {args.layers} layers, "
          f"{args.experts} experts (top-2); batch-1 decode, {args.tokens} tokens")
    _, base_experts, base_rate, base_tokens = rows[0][1:]
    print(f"{'weights':32} {'all MiB':>8} {'experts MiB':>12} {'vs float':>9} {'tok/s':>8} {'vs float':>9} "
          f"{'same greedy':>12}")
    for label, size, experts, tokens_per_s, tokens in rows:
        same = next((i for i, (a, b) in enumerate(zip(tokens, base_tokens)) if a != b), len(base_tokens))
        print(f"{label:32} {size / 2**20:8.1f} {experts / 2**20:12.1f} {experts / base_experts:8.2f}x "
              f"{tokens_per_s:8.1f} {tokens_per_s / base_rate:8.2f}x {same:>8}/{len(base_tokens)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
