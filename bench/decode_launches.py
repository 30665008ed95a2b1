"""Triton launches per decode step and layer, counted on the CPU (Triton's interpreter): the fixed
part of a GPU decode step is about one small kernel's time (2-4 us on an H200) per launch.

    TRITON_INTERPRET=1 PYTHONPATH=runtime python bench/decode_launches.py [--layers 4] [--context 300]

A random Llama-shaped decoder (GQA, float32) decodes one token with its block tables as wide as
a CUDA graph's (--table-keys), and decode partitions sized as on a GPU of --sms SMs. Counts only
Triton launches (cuBLAS's projections are four a layer and unchanged).
"""
from __future__ import annotations

import argparse
import json
import math
from collections import Counter

import torch

from kaon_runtime.config import ModelConfig
from kaon_runtime.kernels import activation, kv_cache, norm, paged_attention, rotary
from kaon_runtime.layers.attention import AttentionMetadata
from kaon_runtime.layers.kernel_backend import triton_kernels
from kaon_runtime.models.decoder import DecoderForCausalLM


def count(layers: int, context: int, table_keys: int, sms: int, block: int = 16) -> tuple[Counter, Counter]:
    config = ModelConfig(architecture="llama", vocab_size=256, hidden_size=256, intermediate_size=512,
                         num_layers=layers, num_heads=8, num_kv_heads=2, head_dim=32,
                         max_position_embeddings=table_keys, rope_theta=500000.0)
    torch.manual_seed(0)
    model = DecoderForCausalLM(config, kernels=triton_kernels()).float()
    with torch.no_grad():
        for param in model.parameters():  # some are made empty, for the checkpoint to fill
            param.normal_(0, 0.02)
    blocks = table_keys // block
    for attn in model.attention_layers():
        attn.k_cache = torch.randn(2, blocks, block, 32)
        attn.v_cache = torch.randn(2, blocks, block, 32)
    paged_attention._auto_partition = lambda programs, max_len, device: paged_attention.partition_size(
        programs, max_len, sms)  # the GPU's split, not the interpreter's whole context
    meta = AttentionMetadata(slot_mapping=torch.tensor([context - 1]), num_decode_tokens=1,
                             decode_block_tables=torch.arange(blocks)[None],
                             decode_context_lens=torch.tensor([context]))
    launches: Counter = Counter()
    programs: Counter = Counter()  # programs (CTAs) launched, most of a split decode's return at once
    for module in (activation, kv_cache, norm, paged_attention, rotary):
        for kernel in [k for k in vars(module).values() if hasattr(k, "arg_names") and hasattr(k, "run")]:
            def run(*args, _run=kernel.run, _name=kernel.fn.__name__, **kwargs):
                launches[_name] += 1
                programs[_name] += math.prod(kwargs["grid"])
                return _run(*args, **kwargs)
            kernel.run = run
    with torch.inference_mode():
        model(torch.tensor([5]), torch.tensor([context - 1]), meta)
    return launches, programs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--table-keys", type=int, default=131072,
                        help="block-table width in keys (a CUDA graph's: the longest context, 128K for Llama 3.1)")
    parser.add_argument("--sms", type=int, default=132)
    args = parser.parse_args()
    launches, programs = count(args.layers, args.context, args.table_keys, args.sms)
    total = sum(launches.values())
    # The final norm is the one launch outside the layers.
    print(json.dumps({"per_step": total, "per_layer": (total - 1) / args.layers, "by_kernel": dict(launches),
                      "programs_by_kernel": dict(programs)},
                     indent=1))


if __name__ == "__main__":
    main()
