"""Tiny random models with random LoRA adapters made by peft itself, and their merged HF references."""
from __future__ import annotations

import torch

from support.hf_dirs import write_hf_dir

SMALL = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
FAMILIES = {"llama": "Llama", "qwen2": "Qwen2"}
# Distinct ranks, scalings (rsLoRA included) and target modules, so each adapter changes other weights.
ADAPTERS = {
    "attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": dict(r=8, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "all": dict(r=2, lora_alpha=16, use_rslora=True,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "qv": dict(r=16, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
}


def build_base(family: str, path, gguf_path, **overrides):
    """Write a tiny random model of `family` (llama or qwen2), SMALL with `overrides`, to `path`; return it
    (float32, eval)."""
    import transformers
    prefix = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, f"{prefix}Config")(**{**SMALL, **overrides})
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    write_hf_dir(model, path, gguf_path, {"eos_token": "<|im_end|>"})
    return model


def build_adapter(base, name: str, path, seed: int, **config) -> None:
    """Save a random PEFT LoRA adapter for `base` (B not zero: init_lora_weights=False), its weights
    scaled up so that it changes the greedy tokens."""
    import peft
    torch.manual_seed(seed)
    lora = peft.get_peft_model(_copy(base), peft.LoraConfig(init_lora_weights=False, **config))
    with torch.no_grad():
        for key, p in lora.named_parameters():
            if "lora_" in key:
                p.normal_(0, 0.3)
    lora.save_pretrained(path)


def build_adapters(base, root, configs: dict[str, dict]) -> dict[str, str]:
    """One adapter per config, saved under root/<name> with seeds 1, 2, ... in order; their directories by name."""
    dirs = {}
    for seed, (name, config) in enumerate(configs.items(), 1):
        dirs[name] = str(root / name)
        build_adapter(base, name, root / name, seed, **config)
    return dirs


def merged(base, adapter_dir):
    """The base with the adapter merged into its weights, by peft."""
    import peft
    return peft.PeftModel.from_pretrained(_copy(base), str(adapter_dir)).merge_and_unload().eval()


def greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=2)
    return out[0, len(prompt):].tolist()


def _copy(model):
    import copy
    return copy.deepcopy(model)
