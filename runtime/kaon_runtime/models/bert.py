"""BERT-family sentence encoders (all-MiniLM-L6-v2 and its kin): `kaon serve --task embed` on a BertModel.

An encoder is not a decoder with an option: every token attends to every other (bidirectional,
so no causal mask, no paged KV cache and no chunked prefill: the whole input is one forward),
the input adds absolute position and token-type embeddings, and each sublayer is post-LN
(LayerNorm after the residual add, with biases). So it is its own small module, and the
decoder path (models/decoder.py) is untouched. Weights use HF's BertModel names, with or
without the "bert." prefix of BertFor* checkpoints.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

ENCODER_MODEL_TYPES = ("bert",)


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str = "gelu"

    @classmethod
    def of_checkpoint(cls, root: Path) -> BertConfig:
        raw = json.loads((root / "config.json").read_text())
        if raw.get("model_type") not in ENCODER_MODEL_TYPES:
            raise ValueError(f"{root}: model_type {raw.get('model_type')!r} is not an encoder kaon serves "
                             f"({', '.join(ENCODER_MODEL_TYPES)})")
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{root}: only absolute position embeddings are supported")
        if raw.get("hidden_act", "gelu") not in ("gelu", "gelu_new"):
            raise ValueError(f"{root}: hidden_act {raw.get('hidden_act')!r} is not supported (gelu, gelu_new)")
        return cls(**{name: raw[name] for name in cls.__dataclass_fields__ if name in raw})


def is_encoder_checkpoint(path: Path) -> bool:
    """Whether a resolved model path is an HF directory of an encoder this module serves."""
    try:
        return json.loads((path / "config.json").read_text()).get("model_type") in ENCODER_MODEL_TYPES
    except (OSError, ValueError, AttributeError):
        return False


class BertLayer(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.heads = c.num_attention_heads
        self.query = nn.Linear(c.hidden_size, c.hidden_size)
        self.key = nn.Linear(c.hidden_size, c.hidden_size)
        self.value = nn.Linear(c.hidden_size, c.hidden_size)
        self.attention_out = nn.Linear(c.hidden_size, c.hidden_size)
        self.attention_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.intermediate = nn.Linear(c.hidden_size, c.intermediate_size)
        self.output = nn.Linear(c.intermediate_size, c.hidden_size)
        self.output_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.approximate = "tanh" if c.hidden_act == "gelu_new" else "none"

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """x: [batch, seq, hidden]; keep: [batch, 1, 1, seq] True where a key is a real token (not padding)."""
        b, s, h = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, h // self.heads).transpose(1, 2)

        attended = F.scaled_dot_product_attention(split(self.query(x)), split(self.key(x)), split(self.value(x)),
                                                  attn_mask=keep)  # bidirectional: no causal mask
        x = self.attention_norm(x + self.attention_out(attended.transpose(1, 2).reshape(b, s, h)))  # post-LN
        return self.output_norm(x + self.output(F.gelu(self.intermediate(x), approximate=self.approximate)))


class BertEncoder(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.config = c
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.embeddings_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(c) for _ in range(c.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The last hidden state [batch, seq, hidden] of right-padded ids (mask 1 for tokens, 0 for padding);
        one segment, so every token type is 0 (as sentence-transformers encodes a sentence)."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embeddings_norm(self.word_embeddings(input_ids) + self.position_embeddings(positions)[None]
                                 + self.token_type_embeddings(torch.zeros_like(input_ids)))
        keep = attention_mask.bool()[:, None, None, :]
        for layer in self.layers:
            x = layer(x, keep)
        return x


# HF BertModel name (after "encoder.layer.N.") -> this module's name (after "layers.N.")
_LAYER_NAMES = {
    "attention.self.query": "query", "attention.self.key": "key", "attention.self.value": "value",
    "attention.output.dense": "attention_out", "attention.output.LayerNorm": "attention_norm",
    "intermediate.dense": "intermediate", "output.dense": "output", "output.LayerNorm": "output_norm",
}
_TOP_NAMES = {"embeddings.word_embeddings": "word_embeddings", "embeddings.position_embeddings": "position_embeddings",
              "embeddings.token_type_embeddings": "token_type_embeddings", "embeddings.LayerNorm": "embeddings_norm"}


def own_name(hf_name: str) -> str | None:
    """This module's parameter name for an HF BertModel tensor; None for tensors it does not use
    (the pooler, position_ids buffers, a masked-LM head)."""
    name = hf_name.removeprefix("bert.")
    module, _, leaf = name.rpartition(".")
    leaf = {"gamma": "weight", "beta": "bias"}.get(leaf, leaf)  # old checkpoints' LayerNorm names
    if module in _TOP_NAMES:
        return f"{_TOP_NAMES[module]}.{leaf}"
    if module.startswith("encoder.layer."):
        index, _, rest = module[len("encoder.layer."):].partition(".")
        if rest in _LAYER_NAMES:
            return f"layers.{index}.{_LAYER_NAMES[rest]}.{leaf}"
    return None


def load_bert(root: Path, dtype: torch.dtype = torch.float32) -> BertEncoder:
    """The encoder of an HF directory (config.json + *.safetensors), every weight checked present."""
    model = BertEncoder(BertConfig.of_checkpoint(root))
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(root.glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            mine = own_name(name)
            if mine is not None:
                tensors[mine] = tensor
    missing = set(model.state_dict()) - set(tensors)
    if missing:
        raise ValueError(f"{root}: the checkpoint lacks {len(missing)} encoder weights, e.g. {sorted(missing)[0]}")
    model.load_state_dict(tensors, strict=True)
    return model.to(dtype).eval()


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The mean over each row's real tokens (padding left out), in float32: sentence-transformers' Pooling."""
    mask = attention_mask.to(torch.float32)[..., None]
    return (hidden.float() * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)


def cls_pool(hidden: torch.Tensor) -> torch.Tensor:
    return hidden[:, 0].float()
