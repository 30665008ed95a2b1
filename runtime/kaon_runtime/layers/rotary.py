"""Rotary position embedding (HF's split-halves layout), with Llama 3, linear and LongRoPE scaling.

LongRoPE (Phi-3) has two sets of frequency factors: short ones for contexts up to the
pretraining length and long ones beyond. HF switches per forward pass on the longest
position in it, which would make the keys cached for a prefix depend on the requests that
shared it; here the choice is fixed per model instance by the context it serves
(max_positions): long factors when it exceeds the pretraining length, as vLLM does. Both
agree with HF whenever a sequence stays on one side of the pretraining length.
"""
from __future__ import annotations

import math

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, base: float, scaling: dict | None = None):
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        self.attention_factor = 1.0  # cos and sin are scaled by it (LongRoPE)
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "longrope":
            inv_freq, self.attention_factor = _longrope(exponents, base, max_positions, scaling)
        else:
            inv_freq = 1.0 / (base ** exponents)
            if scaling is not None:
                inv_freq = _scale_inv_freq(inv_freq, scaling)
        self.inv_freq, self.max_positions = inv_freq, max_positions
        # Built on first use on the activations' device: the model may be created on "meta".
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def lookup(self, positions: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for these positions, [T, 1, D/2] each; once per step, shared by every layer."""
        cos, sin = self.tables(device)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every position, [max_positions, D/2] each, float32."""
        if self._cos_sin is None or self._cos_sin[0].device != device:
            freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32, device="cpu"), self.inv_freq)
            cos, sin = freqs.cos(), freqs.sin()
            if self.attention_factor != 1.0:
                cos, sin = cos * self.attention_factor, sin * self.attention_factor
            self._cos_sin = cos.to(device), sin.to(device)
        return self._cos_sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] -> rotated copy (HF's split-halves layout), computed in float32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind != "llama3":
        raise ValueError(f"unsupported rope scaling {kind!r}")
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    middle = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(middle, blended, out)


def _longrope(exponents: torch.Tensor, base: float, max_positions: int, scaling: dict) -> tuple[torch.Tensor, float]:
    """Phi-3's frequencies, each divided by its factor, and the cos/sin scale that keeps attention's temperature."""
    original = scaling["original_max_position_embeddings"]
    factors = scaling["long_factor"] if max_positions > original else scaling["short_factor"]
    if len(factors) != exponents.numel():
        raise ValueError(f"longrope has {len(factors)} factors for {exponents.numel()} frequencies")
    inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32, device="cpu") * base ** exponents)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        # The checkpoint's context over the pretraining one (the loader fills "factor" in when the config lacks it).
        factor = scaling["factor"]
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freq, attention_factor
