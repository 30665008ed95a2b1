"""compressed-tensors checkpoints (what llm-compressor writes), read from their published layout.

- pack-quantized (W4A16, W8A16): `weight_packed` int32 [N, K * bits / 32], value i of a word at bits
  i * bits, stored as q + 2^(bits - 1); `weight_scale` [N, groups]; `weight_shape` [N, K];
  `weight_zero_point` when asymmetric (packed the same way along N); `weight_g_idx` [K] for act-order.
- int-quantized (W8A8, W8A16 naive): `weight` int8 [N, K], `weight_scale` [N, 1] (channel), [N, groups] or [1].
- float-quantized (FP8): `weight` float8_e4m3fn [N, K], `weight_scale` [1] (tensor), [N, 1] (channel) or
  [ceil(N / 128), ceil(K / 128)] (block).
Static activation quantization (`input_activations` with dynamic false, per tensor: FP8's or int8's
`input_scale`) is applied (quant/static_inputs.py), and so is W8A8's dynamic per-token int8 (int8 x int8
products, quant/dynamic_inputs.py) and FP8 dynamic's per-token FP8 (inputs rounded to FP8 per row,
quant/dynamic_fp8.py).
A `kv_cache_scheme` (an FP8 KV cache's static k_scale / v_scale) loads with a warning and its scales
unused: kaon has no FP8 KV cache, so keys and values stay in --kv-cache-dtype (more memory than the
publisher planned, no less accuracy), as vLLM does unless told `--kv-cache-dtype fp8`.
"""
from __future__ import annotations

import logging

import torch

from kaon_runtime.arith import ceil_div
from kaon_runtime.errors import ModelLoadError
from kaon_runtime.quant.checkpoint_formats.gptq import reference_fused
from kaon_runtime.quant.checkpoint_formats.loaded import LoadedWeight, grouped_weight
from kaon_runtime.quant.checkpoint_formats.packing import unpack_int32
from kaon_runtime.quant.checkpoint_formats.scheme import CheckpointScheme

FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")
_SUFFIXES = frozenset({"weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx"})
_STATIC = frozenset({"input_scale", "input_zero_point"})  # read when activations are static
log = logging.getLogger(__name__)
_IGNORED = frozenset({"input_scale", "input_zero_point", "output_scale", "output_zero_point", "k_scale",
                      "v_scale", "input_global_scale", "weight_global_scale"})


def scheme(config: dict) -> CheckpointScheme:
    groups = list((config.get("config_groups") or {}).values())
    fmt = config.get("format")
    formats = {group.get("format") or fmt for group in groups}
    unknown = formats - set(FORMATS)
    if unknown or not groups:
        raise ModelLoadError(f"compressed-tensors format {sorted(map(str, unknown)) or 'without config_groups'} "
                             f"is not supported; supported: {', '.join(FORMATS)}")
    weights = [group.get("weights") or {} for group in groups]
    kinds = {(w.get("type", "int"), w.get("num_bits")) for w in weights}
    if not kinds <= {("int", 4), ("int", 8), ("float", 8)}:
        raise ModelLoadError(f"compressed-tensors weights {sorted(map(str, kinds))} are not supported; "
                             "supported: int 4-bit, int 8-bit, float 8-bit")
    if config.get("kv_cache_scheme"):
        log.warning("compressed-tensors kv_cache_scheme: kaon has no quantized KV cache, so the checkpoint's "
                    "k_scale / v_scale are not used and keys and values stay in --kv-cache-dtype")
    static = _static_inputs([group.get("input_activations") or {} for group in groups])
    dynamic = _dynamic_inputs([group.get("input_activations") or {} for group in groups], weights)
    kind = sorted(kinds)[0]
    method = "fp8" if kind[0] == "float" else f"int{kind[1]}"
    if method == "fp8":  # the C step's FP8 kinds: per channel or per tensor (Fp8Linear) weight-only, with FP8
        # dynamic's per-token inputs or with static FP8 inputs; block-scaled (Fp8BlockLinear) weight-only or with
        # static FP8 inputs
        strategies = {w.get("strategy") for w in weights}
        fused = (strategies <= {"channel", "tensor"} and static in (None, "fp8")) or (
            strategies == {"block"} and static in (None, "fp8") and dynamic is None)
    elif dynamic == "int8":  # W8A8 int8, per-token inputs: the C step's INT8_A8 (int8 weights per channel/tensor)
        fused = static is None
    elif static == "int8":  # W8A8 int8, a static input grid: the C step's INT8_S8 (int8 weights per channel/tensor)
        fused = all((w.get("type", "int"), w.get("num_bits"), w.get("strategy")) in (("int", 8, "channel"),
                                                                                     ("int", 8, "tensor"))
                    for w in weights)
    else:
        fused = all(_cpu_fused(w) for w in weights) and static is None and dynamic is None
    reference = None  # W8A8 / FP8: as fused (their kinds compute what the checkpoint specifies)
    if method != "fp8" and static is None and dynamic is None:  # weight-only int: the reference kinds
        reference = all(reference_fused(int(w.get("num_bits") or 0), -1 if w.get("strategy") == "channel"
                                        else int(w.get("group_size") or -1)) for w in weights)
    parts = sorted(f"{w.get('strategy')}" + (f" {w['group_size']}" if w.get("group_size") else "") for w in weights)
    return CheckpointScheme(description=f"compressed-tensors {'/'.join(sorted(map(str, formats)))} "
                                        f"{method} ({', '.join(parts)})",
                            method=method, cpu_fused=fused, markers=frozenset({"weight_packed", "weight_scale"}),
                            suffixes=_SUFFIXES | (_STATIC if static else frozenset()),
                            ignored=_IGNORED - (_STATIC if static else frozenset()), convert=convert,
                            static_inputs=static, dynamic_inputs=dynamic, cpu_reference=reference)


def _dynamic_inputs(activations: list[dict], weights: list[dict]) -> str | None:
    """"int8" when every group quantizes its inputs to int8 per token at run time (W8A8), "fp8" when every
    group rounds them to FP8 per token (FP8 dynamic), None when none quantizes them dynamically; int8 needs
    int8 weights per channel (or per tensor), fp8 FP8 weights per channel or per tensor."""
    if any(a and a.get("dynamic") in (True, "local") and a.get("type") == "float" for a in activations):
        return _dynamic_fp8_inputs(activations, weights)
    dynamic = [a for a in activations if a and a.get("dynamic") in (True, "local") and a.get("type", "int") == "int"]
    if not dynamic:
        return None
    kinds = {(a.get("num_bits"), a.get("strategy"), a.get("symmetric", True)) for a in dynamic}
    weight_kinds = {(w.get("type", "int"), w.get("num_bits"), w.get("strategy")) for w in weights}
    if (len(dynamic) != len(activations) or kinds != {(8, "token", True)}
            or not weight_kinds <= {("int", 8, "channel"), ("int", 8, "tensor")}):
        raise ModelLoadError(f"compressed-tensors dynamic input_activations {sorted(map(str, kinds))} with weights "
                             f"{sorted(map(str, weight_kinds))} are not supported; supported: symmetric int 8-bit "
                             "per token in every group, with int 8-bit weights per channel or per tensor")
    return "int8"


def _dynamic_fp8_inputs(activations: list[dict], weights: list[dict]) -> str:
    kinds = {(a.get("type"), a.get("num_bits"), a.get("strategy"), a.get("dynamic") in (True, "local"))
             for a in activations}
    weight_kinds = {(w.get("type", "int"), w.get("num_bits"), w.get("strategy")) for w in weights}
    if kinds != {("float", 8, "token", True)} or not weight_kinds <= {("float", 8, "channel"), ("float", 8, "tensor")}:
        raise ModelLoadError(f"compressed-tensors dynamic input_activations {sorted(map(str, kinds))} with weights "
                             f"{sorted(map(str, weight_kinds))} are not supported; supported: float 8-bit per token "
                             "in every group, with float 8-bit weights per channel or per tensor")
    return "fp8"


def _static_inputs(activations: list[dict]) -> str | None:
    """"fp8" / "int8" when every group quantizes its inputs statically per tensor, None when none does."""
    static = [a for a in activations if a and a.get("dynamic") is False]
    if not static:
        return None
    kinds = {(a.get("type", "int"), a.get("num_bits"), a.get("strategy", "tensor")) for a in static}
    supported = {("float", 8, "tensor"), ("int", 8, "tensor")}
    if len(static) != len(activations) or len(kinds) != 1 or not kinds <= supported:
        raise ModelLoadError(f"compressed-tensors static input_activations {sorted(map(str, kinds))} are not "
                             "supported; supported: per-tensor float 8-bit or int 8-bit in every group")
    return "fp8" if kinds == {("float", 8, "tensor")} else "int8"


def _cpu_fused(weights: dict) -> bool:
    """The fused CPU step reads kaon's int4 in groups of 32, its per-channel int8 and GGUF's group-int8
    (groups of 16): on CPU wider groups are split into those."""
    if weights.get("actorder") not in (None, "weight", "static"):
        return False
    if weights.get("num_bits") == 4:
        return weights.get("strategy") == "channel" or (weights.get("strategy") == "group"
                                                         and (weights.get("group_size") or 1) % 32 == 0)
    # 8-bit groups that are not a multiple of 16: read as held, float32 activations (REF_Q8_G)
    return weights.get("strategy") == "channel" or (weights.get("group_size") or 1) % 16 == 0 or (
        weights.get("num_bits") == 8 and weights.get("strategy") == "group")


def convert(name: str, t: dict[str, torch.Tensor], in_features: int) -> LoadedWeight:
    if "weight_packed" in t:
        return _packed(name, t, in_features)
    weight = _need(name, t, "weight")
    if weight.dim() != 2 or weight.shape[1] != in_features:
        raise ValueError(f"{name}.weight has shape {tuple(weight.shape)}; the layer has {in_features} input columns")
    if weight.dtype == torch.float8_e4m3fn:
        return _fp8(name, weight, _need(name, t, "weight_scale"))
    if weight.dtype != torch.int8:
        raise ValueError(f"{name}.weight is {weight.dtype}; a quantized layer's weight must be int8 or float8_e4m3fn")
    n = weight.shape[0]
    scales = _per_group(name, _need(name, t, "weight_scale"), n)
    zeros = t.get("weight_zero_point")
    zeros = torch.zeros_like(scales) if zeros is None else _per_group(name, zeros, n).float()
    return grouped_weight(name, weight.int() + 128, scales, zeros + 128, 8, t.get("weight_g_idx"))


def _packed(name: str, t: dict[str, torch.Tensor], in_features: int) -> LoadedWeight:
    n, k = (int(v) for v in _need(name, t, "weight_shape").tolist())
    if k != in_features:
        raise ValueError(f"{name}.weight_shape says {k} input columns; the layer has {in_features}")
    packed = t["weight_packed"]
    bits = 32 * packed.shape[1] // k if k else 0
    if bits not in (4, 8) or packed.shape != (n, k * bits // 32) or packed.dtype != torch.int32:
        raise ValueError(f"{name}.weight_packed is {packed.dtype} {tuple(packed.shape)}; a {n} x {k} weight packs "
                         f"into int32 [{n}, {k // 8}] (4-bit) or [{n}, {k // 4}] (8-bit)")
    scales = _per_group(name, _need(name, t, "weight_scale"), n)
    offset = 1 << (bits - 1)
    zeros = t.get("weight_zero_point")
    if zeros is None:
        unsigned_zeros = torch.full_like(scales, offset, dtype=torch.float32)
    elif zeros.dtype == torch.int32 and zeros.shape[0] * 32 // bits >= n > (zeros.shape[0] - 1) * 32 // bits:
        unsigned_zeros = unpack_int32(zeros, bits, dim=0)[:n].float()  # packed along N, stored + offset
    else:
        unsigned_zeros = zeros.float().reshape(scales.shape) + offset
    return grouped_weight(name, unpack_int32(packed, bits, dim=1), scales, unsigned_zeros, bits,
                          t.get("weight_g_idx"))


def _fp8(name: str, weight: torch.Tensor, scale: torch.Tensor) -> LoadedWeight:
    n, k = weight.shape
    scale = scale.float()
    if scale.numel() == 1 or scale.shape in ((n,), (n, 1)):  # per tensor or per channel
        return LoadedWeight("fp8", {"qweight": weight, "scales": scale.reshape(-1).expand(n).contiguous()}, k,
                            name=name)
    if scale.dim() == 2:
        rows, cols = ceil_div(n, scale.shape[0]), ceil_div(k, scale.shape[1])
        if (ceil_div(n, rows), ceil_div(k, cols)) == tuple(scale.shape):
            return LoadedWeight("fp8_block", {"qweight": weight, "scales": scale}, cols, block_rows=rows, name=name)
    raise ValueError(f"{name}.weight_scale has shape {tuple(scale.shape)}, which fits no FP8 strategy "
                     f"(tensor, channel, block) of a {n} x {k} weight")


def _per_group(name: str, scale: torch.Tensor, n: int) -> torch.Tensor:
    """A scale or zero point as [N, groups]: per-tensor values are repeated over the rows."""
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(n, 1)
    if scale.dim() == 1 and scale.shape[0] == n:
        return scale[:, None]
    if scale.dim() != 2 or scale.shape[0] != n:
        raise ValueError(f"{name}: scale or zero point of shape {tuple(scale.shape)} does not fit {n} output rows")
    return scale


def _need(name: str, t: dict[str, torch.Tensor], suffix: str) -> torch.Tensor:
    if suffix not in t:
        raise ValueError(f"{name}.{suffix} is missing from the checkpoint")
    return t[suffix]
