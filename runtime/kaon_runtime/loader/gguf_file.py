"""GGUF loading: metadata -> ModelConfig, quantized tensors dequantized to HF-named weights
(each family's names and conventions: gguf_families.py).

The layers' quantized tensors are also offered as their raw blocks (GgufCheckpoint.quantized_blocks),
which the engine keeps quantized (quant/gguf.py repacks them into kaon's layouts).
"""
from __future__ import annotations

import contextlib
import logging
import mmap
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
DEQUANTIZE_ROWS = 2048  # rows of a quantized tensor dequantized at once (2048 x 576 floats: 4.5 MB for SmolLM2)


@dataclass(slots=True)
class GgufCheckpoint(Checkpoint):
    """A GGUF file's checkpoint: also the raw blocks of its layers' quantized tensors, each as
    (HF name, GGML type name, uint8 [rows, bytes per row]), rows in HF order."""

    quantized_blocks: Callable[[], Iterator[tuple[str, str, torch.Tensor]]] | None = None
    quantized_types: frozenset[str] = frozenset()  # their GGML type names
    # HF name -> GGML type of each of those, read from the header alone (no tensor data touched)
    quantized_names: Callable[[], dict[str, str]] | None = None
    # weights() leaving out the GGUF tensors whose every HF name `skip` says (never dequantized: the
    # engine takes their blocks as they are)
    weights_skipping: Callable[[Callable[[str], bool]], Iterator[tuple[str, torch.Tensor]]] | None = None
    # the token embedding's GGML type when it is quantized, and its raw blocks (uint8 [vocab, bytes])
    table_type: str | None = None
    table_blocks: Callable[[], torch.Tensor] | None = None
    table_size: tuple[int, int] | None = None  # its (elements, bytes in the file), as tensor_sizes lists it


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

    def hf_names(tensor) -> list[str]:
        """The HF names `tensor` becomes, from its shape alone (a meta tensor: nothing read or copied)."""
        shape = tuple(int(d) for d in reversed(tensor.shape)) if len(tensor.shape) > 1 else (int(tensor.shape[0]),)
        return [name for name, _ in hf_tensors(config, tensor.name, torch.empty(shape, device="meta"))]

    def weights(skip: Callable[[str], bool] | None = None):
        for tensor in reader.tensors:
            if skip is not None and tensor.tensor_type.name not in FLOAT_TYPES:
                names = hf_names(tensor)
                if names and all(skip(name) for name in names):
                    continue
            try:
                floats = _dequantized(gguf, tensor)
            except Exception as exc:
                raise ModelLoadError(f"cannot dequantize {tensor.name} ({tensor.tensor_type.name}) in "
                                     f"{path.name}: {exc}") from exc
            _release(reader, tensor)
            yield from hf_tensors(config, tensor.name, floats)

    # The layers' quantized projections and experts (3-D: [experts, rows, bytes]), offered as blocks too.
    quantized = [t for t in reader.tensors if t.name.startswith("blk.") and t.tensor_type.name not in FLOAT_TYPES
                 and len(t.shape) in (2, 3)]

    def quantized_blocks():
        for tensor in quantized:
            rows = torch.from_numpy(np.array(tensor.data)).view(*tensor.data.shape[:-1], -1)
            _release(reader, tensor)
            for name, data in hf_tensors(config, tensor.name, rows):  # rows move whole: blocks never span rows
                yield name, tensor.tensor_type.name, data

    table = next((t for t in reader.tensors if t.name == "token_embd.weight" and t.tensor_type.name not in FLOAT_TYPES
                  and len(t.data.shape) == 2), None)

    def table_blocks() -> torch.Tensor:
        assert table is not None
        blocks = torch.from_numpy(np.array(table.data)).view(table.data.shape[0], -1)
        _release(reader, table)
        return blocks

    def quantized_names() -> dict[str, str]:
        return {name: tensor.tensor_type.name for tensor in quantized for name in hf_names(tensor)}

    return GgufCheckpoint(path, config, tokenizer, len(reader.tensors), weights,
                          quantized_blocks=quantized_blocks if quantized else None,
                          quantized_types=frozenset(t.tensor_type.name for t in quantized),
                          quantized_names=quantized_names, weights_skipping=weights,
                          tensor_sizes=lambda: [(int(t.n_elements), int(t.n_bytes),
                                                 t.tensor_type.name not in FLOAT_TYPES) for t in reader.tensors],
                          table_type=None if table is None else table.tensor_type.name,
                          table_blocks=None if table is None else table_blocks,
                          table_size=None if table is None else (int(table.n_elements), int(table.n_bytes)))


def _release(reader, tensor) -> None:
    """Drop the file's pages under `tensor` from this process's resident memory once it is copied out: the
    mapping stays (the page cache keeps them, a later read faults them back), but a load that touched every
    page would otherwise count the whole file on top of the weights made from it (issue 49 §3)."""
    mapping = getattr(reader.data, "_mmap", None)
    if mapping is None or not hasattr(mapping, "madvise"):
        return
    page = mmap.PAGESIZE
    start = int(tensor.data_offset) // page * page
    end = int(tensor.data_offset) + int(tensor.n_bytes)
    with contextlib.suppress(OSError, ValueError):  # an advice, not a need: the worst is the old footprint
        mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


def _dequantized(gguf, tensor) -> torch.Tensor:
    """The tensor in float32 (float16 ones stay float16), its own memory (the file is memory-mapped read-only). A
    quantized one is
    dequantized DEQUANTIZE_ROWS rows at a time into that one tensor: gguf's dequantizer makes several
    float temporaries the size of what it is given, which for the whole vocabulary table were the
    largest allocation of the load (issue 49 §3)."""
    data = tensor.data
    if tensor.tensor_type.name == "F16" and data.dtype == np.float16:
        # Kept float16 (a copy, half the bytes): the parameter it is copied into widens it, so a float16 vocabulary
        # table never has a float32 copy beside the model's own.
        return torch.from_numpy(np.array(data))
    if tensor.tensor_type.name in FLOAT_TYPES:
        return torch.from_numpy(np.array(data, dtype=np.float32))
    rows = data.reshape(-1, data.shape[-1])  # blocks never span rows
    first = gguf.quants.dequantize(rows[:1], tensor.tensor_type)
    out = torch.empty((rows.shape[0], first.shape[-1]), dtype=torch.float32)
    for start in range(0, rows.shape[0], DEQUANTIZE_ROWS):
        chunk = gguf.quants.dequantize(rows[start:start + DEQUANTIZE_ROWS], tensor.tensor_type)
        out[start:start + DEQUANTIZE_ROWS] = torch.from_numpy(np.asarray(chunk, dtype=np.float32))
    return out.view(*data.shape[:-1], first.shape[-1])


def _checked_reader(gguf):
    """gguf's reader, refusing a tensor of a type it does not know or that the file ends inside of
    by the tensor's name (gguf's own errors name neither), and reading its header from a plain array view.

    Why the view: the reader cuts every metadata value out of its np.memmap, one slice per string, and
    each slice of a memmap runs memmap's Python-level __array_finalize__. A tokenizer of 49,152 tokens and
    48,900 merges is ~250,000 slices: 5.3 s of the bundled model's ~12 s start on a 2-core Xeon, 1.1 s
    from a plain ndarray over the same mapping (same pages, no copy; every field and tensor compared
    equal). The memmap itself stays (self.data) for _release's madvise."""

    class CheckedReader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            array = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
            return array.view(array.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

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
