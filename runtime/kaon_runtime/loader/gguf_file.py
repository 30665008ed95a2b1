"""GGUF loading: metadata -> ModelConfig, quantized tensors dequantized to HF-named weights
(each family's names and conventions: gguf_families.py).

The layers' quantized tensors are also offered as their raw blocks (GgufCheckpoint.quantized_blocks),
which the engine keeps quantized (quant/gguf.py repacks them into kaon's layouts).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kaon_runtime.errors import ModelLoadError
from kaon_runtime.loader.checkpoint import Checkpoint
from kaon_runtime.loader.gguf_families import hf_tensors, model_config
from kaon_runtime.loader.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# GGML types that are not quantized blocks: the float ones, read as floats.
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


@dataclass(slots=True)
class GgufCheckpoint(Checkpoint):
    """A GGUF file's checkpoint: also the raw blocks of its layers' quantized tensors, each as
    (HF name, GGML type name, uint8 [rows, bytes per row]), rows in HF order."""

    quantized_blocks: Callable[[], Iterator[tuple[str, str, torch.Tensor]]] | None = None
    quantized_types: frozenset[str] = frozenset()  # their GGML type names


def load_gguf(path: Path) -> Checkpoint:
    import gguf

    try:
        reader = _checked_reader(gguf)(str(path))
        fields = {name: _field_value(field) for name, field in reader.fields.items()}
    except ModelLoadError as exc:
        raise ModelLoadError(f"{exc} in {path.name}") from exc
    except Exception as exc:  # the reader raises whatever numpy hits on a broken file
        raise ModelLoadError(f"{path.name} is not a valid GGUF file: {exc}") from exc
    config = model_config(fields, reader.tensors)
    tokenizer = Tokenizer.from_gguf_fields(fields)

    def weights():
        for tensor in reader.tensors:
            try:
                array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            except Exception as exc:
                raise ModelLoadError(f"cannot dequantize {tensor.name} ({tensor.tensor_type.name}) in "
                                     f"{path.name}: {exc}") from exc
            # A copy: the file is memory-mapped read-only.
            yield from hf_tensors(config, tensor.name, torch.from_numpy(np.array(array, dtype=np.float32)))

    # The layers' quantized projections and experts (3-D: [experts, rows, bytes]), offered as blocks too.
    quantized = [t for t in reader.tensors if t.name.startswith("blk.") and t.tensor_type.name not in FLOAT_TYPES
                 and len(t.shape) in (2, 3)]

    def quantized_blocks():
        for tensor in quantized:
            rows = torch.from_numpy(np.array(tensor.data)).view(*tensor.data.shape[:-1], -1)
            for name, data in hf_tensors(config, tensor.name, rows):  # rows move whole: blocks never span rows
                yield name, tensor.tensor_type.name, data

    return GgufCheckpoint(path, config, tokenizer, len(reader.tensors), weights,
                          quantized_blocks=quantized_blocks if quantized else None,
                          quantized_types=frozenset(t.tensor_type.name for t in quantized))


def _checked_reader(gguf):
    """gguf's reader, refusing a tensor of a type it does not know or that the file ends inside of
    by the tensor's name (gguf's own errors name neither)."""

    class CheckedReader(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):
            for field in fields:
                _, name_data, _, dims, raw_type, offset = field.parts
                name = bytes(name_data).decode("utf-8", "replace")
                try:
                    ggml_type = gguf.GGMLQuantizationType(int(raw_type[0]))
                except ValueError:
                    raise ModelLoadError(f"tensor {name} has an unknown GGML type {int(raw_type[0])}") from None
                block, size = gguf.GGML_QUANT_SIZES[ggml_type]
                end = start_offs + int(offset[0]) + int(np.prod(dims)) * size // block
                if end > len(self.data):
                    raise ModelLoadError(f"tensor {name} is truncated: the file ends {end - len(self.data)} bytes "
                                         "before it does")
            super()._build_tensors(start_offs, fields)

    return CheckedReader


def _field_value(field):
    try:
        return field.contents()
    except Exception:  # noqa: BLE001  a field type gguf cannot decode is left out, not fatal
        return None
