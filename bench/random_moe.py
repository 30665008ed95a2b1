"""A random mixture-of-experts model as an HF directory, for bench/cpu_decode.py --model (the fused C step's
MoE layers against torch's path).

    python bench/random_moe.py DIR [--family mixtral|qwen3_moe] [--hidden 512] [--layers 4] [--experts 8]
                                   [--top-k 2] [--width 512]

transformers writes the model (random weights, spread as the tests' tiny directories are: normal, 0.2), the
bundled model's vocabulary as its tokenizer. Its answers mean nothing; its shapes are what is measured.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "runtime"), str(ROOT / "tests")]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("path", type=Path)
    parser.add_argument("--family", choices=["mixtral", "qwen3_moe"], default="mixtral")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--width", type=int, default=512)
    args = parser.parse_args()

    import torch
    import transformers

    from kaon_runtime.loader import resolve_model
    from support.hf_dirs import write_hf_dir

    shape = dict(vocab_size=49152, hidden_size=args.hidden, num_hidden_layers=args.layers,
                 num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256), head_dim=64,
                 max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                 num_experts_per_tok=args.top_k)
    if args.family == "mixtral":
        config = transformers.MixtralConfig(**shape, intermediate_size=args.width, num_local_experts=args.experts)
        model = transformers.MixtralForCausalLM(config)
    else:
        config = transformers.Qwen3MoeConfig(**shape, intermediate_size=4 * args.hidden,
                                             moe_intermediate_size=args.width, num_experts=args.experts,
                                             norm_topk_prob=True)
        model = transformers.Qwen3MoeForCausalLM(config)
    torch.manual_seed(0)
    write_hf_dir(model.eval(), args.path, resolve_model("builtin://smollm2-135m-instruct"),
                 {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    print(f"{args.family}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters in {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
