"""Quantized checkpoints (AWQ, GPTQ, compressed-tensors) read into kaon's own narrow layouts.

`scheme_from_config` reads config.json's quantization_config; the scheme says which tensors
belong to quantized modules and turns each module's tensors into a LoadedWeight (loaded.py),
which becomes one of kaon's quantized linears. Placing them in the model is engine/prequantized.py's job.
"""
from __future__ import annotations

from kaon_runtime.errors import ModelLoadError
from kaon_runtime.quant.checkpoint_formats import compressed_tensors, gptq
from kaon_runtime.quant.checkpoint_formats.loaded import LoadedWeight, concat_rows
from kaon_runtime.quant.checkpoint_formats.scheme import CheckpointScheme

_METHODS = {"compressed-tensors": compressed_tensors.scheme, "gptq": gptq.gptq_scheme, "awq": gptq.awq_scheme}

__all__ = ["CheckpointScheme", "LoadedWeight", "concat_rows", "scheme_from_config"]


def scheme_from_config(config: dict) -> CheckpointScheme:
    """The scheme of config.json's quantization_config; ModelLoadError for a method kaon does not read."""
    method = str(config.get("quant_method", "")).lower()
    if method not in _METHODS:
        raise ModelLoadError(f"quantization_config.quant_method {config.get('quant_method')!r} is not supported; "
                             f"supported: {', '.join(_METHODS)}")
    return _METHODS[method](config)
