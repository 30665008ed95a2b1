"""Tiny quantized mixture-of-experts HF directories (Mixtral, Qwen3-MoE) for the quantized-experts tests.

transformers saves the experts under their per-expert names (Mixtral's block_sparse_moe.experts.<e>.w1/w3/w2,
Qwen3-MoE's mlp.experts.<e>.gate_proj/up_proj/down_proj), which is how published AWQ, GPTQ and
compressed-tensors MoE checkpoints store them. Every linear of the layers but the routers is quantized:
GPTQ and AWQ packed with numpy from their published layouts (support/gptq_awq.py); compressed-
tensors by the compressed-tensors package itself (its scheme applied to modules of the checkpoint's
names, scales from each group's range, its ModelCompressor, and its own fake_quantize as the dequantizer).
Each writer returns the transformers model holding the dequantized weights: the float reference.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn

from support.gptq_awq import pack_linears, quantization_config
from support.hf_dirs import write_hf_dir
from support.quantized_dirs import update_config

SHAPE = dict(vocab_size=49152, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
FAMILIES = {"mixtral": ("Mixtral", dict(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2)),
            "qwen3_moe": ("Qwen3Moe", dict(intermediate_size=256, moe_intermediate_size=128, num_experts=4,
                                           num_experts_per_tok=2, norm_topk_prob=True))}
TOKENIZER = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}


def tiny_moe(family: str, seed: int = 0):
    import transformers

    prefix, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, f"{prefix}Config")(**SHAPE, **extra)
    return getattr(transformers, f"{prefix}ForCausalLM")(config).eval()


def quantized_names(state: dict[str, torch.Tensor]) -> list[str]:
    """The linears a quantized MoE checkpoint stores quantized: every layer projection and expert, not the router."""
    return sorted(name.removesuffix(".weight") for name, t in state.items()
                  if name.startswith("model.layers.") and name.endswith(".weight") and t.dim() == 2
                  and not name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight")))


def write_packed_moe_dir(path: Path, gguf_path, family: str, method: str, bits: int, group: int, sym: bool):
    """GPTQ (AutoGPTQ's v1 format, zero - 1 stored) or AutoAWQ GEMM; returns the dequantized reference."""
    from safetensors.torch import load_file, save_file

    write_hf_dir(tiny_moe(family), path, gguf_path, TOKENIZER)
    state = load_file(path / "model.safetensors")
    dequantized = pack_linears(state, dict.fromkeys(quantized_names(state)), method, bits, group, sym)
    reference = _reference(path, dequantized)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    update_config(path, quantization_config=quantization_config(method, bits, group, sym))
    return reference


def write_compressed_tensors_moe_dir(path: Path, gguf_path, family: str, weights: dict, fmt: str):
    """compressed-tensors with weight arguments `weights` in format `fmt`, routers and lm_head ignored;
    returns the reference holding compressed-tensors' own dequantized weights."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file, save_file

    write_hf_dir(tiny_moe(family), path, gguf_path, TOKENIZER)
    state = load_file(path / "model.safetensors")
    names = quantized_names(state)
    linears = _modules_named(names, state)
    args = QuantizationArgs(**weights)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"], format=fmt)
    apply_quantization_config(linears, config)
    dequantized = {}
    with torch.no_grad():
        for name in names:
            module = linears.get_submodule(name)
            w = module.weight
            n, k = w.shape
            if args.strategy == "group":
                lo, hi = (f(w.reshape(n, k // args.group_size, -1), -1) for f in (torch.amin, torch.amax))
            else:
                lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
            scale, zero = calculate_qparams(lo, hi, args)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if getattr(module, "weight_zero_point", None) is not None:
                module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
            dequantized[f"{name}.weight"] = fake_quantize(w, module.weight_scale, module.weight_zero_point, args)
    reference = _reference(path, dequantized)
    compressor = ModelCompressor.from_pretrained_model(linears, quantization_format=fmt)
    compressor.compress_model(linears)
    for name in names:
        del state[f"{name}.weight"]
    state.update({key: t.contiguous() for key, t in linears.state_dict().items()})
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    compressor.update_config(str(path))
    return reference


def _modules_named(names: list[str], state: dict[str, torch.Tensor]) -> nn.Module:
    """A module tree holding an nn.Linear of the checkpoint's weight under each of `names`."""
    root = nn.Module()
    for name in names:
        parent = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        weight = state[f"{name}.weight"]
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        linear.weight.data.copy_(weight)
        parent.add_module(leaf, linear)
    return root


def _reference(path: Path, dequantized: dict[str, torch.Tensor]):
    """transformers on a copy of the float directory whose quantized weights are their dequantized values."""
    import transformers
    from safetensors.torch import load_file, save_file

    reference = path.parent / f"{path.name}-reference"
    shutil.copytree(path, reference)
    state = load_file(reference / "model.safetensors")
    state.update({name: t.float().contiguous() for name, t in dequantized.items()})
    save_file(state, reference / "model.safetensors", metadata={"format": "pt"})
    return transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
