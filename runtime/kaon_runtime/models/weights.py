"""HF checkpoint names -> the shared decoder's parameters, for every supported family.

Our parameters are fused where HF checkpoints keep parts apart: q|k|v in qkv_proj,
gate|up in gate_up_proj, and an MoE layer's experts stacked in w13 (gate|up) and w2.
Checkpoints that are already fused (Phi-3's qkv_proj and gate_up_proj) are first split
into the standard parts, so tensor-parallel cutting (sharding.cut) sees one layout only.
Mixtral's names (block_sparse_moe, w1/w3/w2) are renamed to Qwen3-MoE's (mlp, gate/up/down_proj).
"""
from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Protocol

import torch

from kaon_runtime.config import ModelConfig
from kaon_runtime.distributed.sharding import cut

_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_PARAMS = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None)}
_MIXTRAL_EXPERT = {".w1.weight": ".gate_proj.weight", ".w3.weight": ".up_proj.weight",
                   ".w2.weight": ".down_proj.weight"}

Part = int | tuple[int, int | None] | None  # a fused shard, or (expert, shard) of a stacked expert tensor


def standard_names(name: str, tensor: torch.Tensor, c: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensor under Llama/Qwen3-MoE names, split into q/k/v and gate/up when the checkpoint fused them."""
    name = qwen3_moe_name(name)
    if name.endswith((".self_attn.qkv_proj.weight", ".self_attn.qkv_proj.bias")):
        sizes = [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        for part, piece in zip(("q_proj", "k_proj", "v_proj"), tensor.split(sizes)):
            yield name.replace("qkv_proj", part), piece
    elif name.endswith(".mlp.gate_up_proj.weight"):
        gate, up = tensor.chunk(2)
        yield name.replace("gate_up_proj", "gate_proj"), gate
        yield name.replace("gate_up_proj", "up_proj"), up
    else:
        yield name, tensor


def qwen3_moe_name(name: str) -> str:
    """A Mixtral checkpoint name (block_sparse_moe, experts' w1 / w3 / w2) under Qwen3-MoE's names; others as is."""
    if ".block_sparse_moe." in name:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        for old, new in _MIXTRAL_EXPERT.items():
            if ".experts." in name and name.endswith(old):
                name = name[:-len(old)] + new
    return name


def target(name: str) -> tuple[str, Part]:
    """Our parameter for a standard HF name, and which part of it the tensor fills."""
    match = _EXPERT.search(name)
    if match:
        param, shard = _EXPERT_PARAMS[match.group(2)]
        return f"{name[:match.start()]}.{param}", (int(match.group(1)), shard)
    for part, (fused, shard) in _FUSED.items():
        if f".{part}." in name:
            return name.replace(part, fused), shard
    return name, None


def expected_parts(name: str, param: torch.Tensor) -> list[Part]:
    if "qkv_proj" in name:
        return [0, 1, 2]
    if "gate_up_proj" in name:
        return [0, 1]
    if name.endswith(".w13"):
        return [(e, s) for e in range(param.shape[0]) for s in (0, 1)]
    if name.endswith(".w2"):
        return [(e, None) for e in range(param.shape[0])]
    return [None]


def part_of(param: torch.Tensor, name: str, part: Part, c: ModelConfig) -> torch.Tensor:
    """The view of `param` that `part` fills; c is this rank's (local) config."""
    if isinstance(part, tuple):
        param, part = param[part[0]], part[1]
    if part is None:
        return param
    if "qkv_proj" in name:
        sizes = [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
    else:  # gate|up halves, of a dense MLP or of one expert
        sizes = [param.shape[0] // 2] * 2
    return param.narrow(0, sum(sizes[:part]), sizes[part])


class Deferred(Protocol):
    """Parameters made and consumed as they arrive (quant/on_load.QuantizeOnLoad: linears quantized as they load)."""

    def watched(self) -> set[str]: ...  # the model's own parameters whose last part `filled` hears of too
    def places(self) -> dict[str, torch.Tensor]: ...  # parameter name -> its meta tensor (shape)
    def buffer(self, param_name: str) -> torch.Tensor: ...  # where its parts are copied, made on the first
    def filled(self, param_name: str) -> None: ...  # every part of it has arrived


def load(model, weights: Iterable[tuple[str, torch.Tensor]], deferred: Deferred | None = None) -> None:
    """Copy HF-named tensors into `model` (a DecoderForCausalLM), each cut to its rank's shard; `deferred`'s
    parameters into its buffers, each handed back (`filled`) once its last part is in and the stream has moved on
    (by then a memory-mapped file's pages of that part are released: engine/model_loader._released_once_copied)."""
    params = dict(model.named_parameters())
    places = deferred.places() if deferred is not None else {}
    params.update(places)
    watched = deferred.watched() if deferred is not None else set()
    waiting = {name: set(expected_parts(name, params[name])) for name in [*places, *watched]}
    c, tp = model.config, model.tp
    tied = c.tie_word_embeddings
    loaded: set[tuple[str, Part]] = set()
    ready: list[str] = []  # complete, `filled` when the next tensor has come

    def place(raw_name: str, raw: torch.Tensor) -> None:
        for name, tensor in standard_names(raw_name, raw, c):
            tensor = cut(name, tensor, c, tp.rank, tp.size)
            if name == "lm_head.weight" or (tied and name == "model.embed_tokens.weight"):
                name, tensor = "lm_head.weight_t", tensor.t()
            param_name, part = target(name)
            if param_name not in params:
                raise KeyError(f"checkpoint tensor {raw_name!r} has no place in the model")
            if param_name in places or param_name in watched:
                assert deferred is not None
                if param_name not in waiting:
                    raise ValueError(f"checkpoint tensor {raw_name!r} comes again after its layer was already "
                                     "quantized")
                _copy(part_of(deferred.buffer(param_name) if param_name in places else params[param_name].data,
                              param_name, part, model.local_config), tensor, raw_name)
                waiting[param_name].discard(part)
                if not waiting[param_name]:
                    del waiting[param_name]
                    if param_name in watched:
                        params[param_name] = params[param_name].to("meta")  # (its shape, for the check below)
                    ready.append(param_name)
            else:
                _copy(part_of(params[param_name].data, param_name, part, model.local_config), tensor, raw_name)
            loaded.add((param_name, part))

    for raw_name, raw in weights:
        while ready:  # (the stream has moved on: the last part's file pages are released)
            assert deferred is not None
            deferred.filled(ready.pop(0))
        if raw_name == "lm_head.weight" and tied:
            continue  # some checkpoints store a copy of the tied weight anyway
        place(raw_name, raw)
    for name in ready:
        assert deferred is not None
        deferred.filled(name)
    expected = {(n, p) for n, param in params.items() for p in expected_parts(n, param)}
    missing = sorted(f"{n}[{p}]" if p is not None else n for n, p in expected - loaded)
    if missing:
        raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def fuse_rows(tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack HF-named per-output-row tensors the way `load` fuses weights: q|k|v and gate|up
    along dim 0, keyed by parameter name. A fused group missing a part is left out."""
    parts: defaultdict[str, dict] = defaultdict(dict)
    for name, tensor in tensors:
        param_name, part = target(name)
        parts[param_name][part] = tensor
    groups = {}
    for param_name, shards in parts.items():
        wanted = [0, 1, 2] if "qkv_proj" in param_name else [0, 1] if "gate_up_proj" in param_name else [None]
        if set(shards) == set(wanted):
            groups[param_name] = torch.cat([shards[s] for s in wanted])
    return groups


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"tensor {name!r} has shape {tuple(src.shape)}, the model expects {tuple(dst.shape)}")
    dst.copy_(src)
