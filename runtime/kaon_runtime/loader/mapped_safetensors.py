"""A safetensors file's tensors memory-mapped, not read: each is a view of the file's pages (issue 53 §2).

The file is mapped copy-on-write (numpy's mode "c"): nothing is read until a tensor is used, the page
cache is shared with every other process mapping the same file, and a write lands in a private page
instead of the file. A tensor the engine keeps as it is (an int8 or FP8 weight already in its kernel
layout) is then used in place, never copied; one that must change (fused, transposed, repacked, widened)
is converted from the mapping one tensor at a time, so no second copy of the checkpoint exists.

Pages read stay resident in this process until the mapping goes, so a load that converts every tensor
would hold the whole file beside the weights made from it (issue 49 §3: FP8-dynamic and W8A8 peaked
1.17x their settled size). `release_pages` drops a converted tensor's pages again (MADV_DONTNEED, as the
GGUF reader does): the page cache keeps them, a later read faults them back in from the file. Dropping a
page also drops a private write to it, so only a consumer that knows it has copied a tensor, or never
wrote to it, releases it (engine/model_loader.py for the streamed float weights, engine/prequantized.py
for the quantized ones); the stream itself never does.

The layout is safetensors' own: 8 bytes of little-endian header length, a JSON header of name ->
{dtype, shape, data_offsets} (offsets relative to the end of the header), then the data.
"""
from __future__ import annotations

import contextlib
import json
import mmap
import struct
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def header(file: Path) -> tuple[int, dict]:
    """(where the data starts, the header's tensor entries); ValueError for a file that is not safetensors."""
    with open(file, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError("shorter than a safetensors header")
        length = struct.unpack("<Q", prefix)[0]
        if length > 100 << 20:
            raise ValueError(f"a header of {length} bytes")
        entries = json.loads(f.read(length))
    entries.pop("__metadata__", None)
    return 8 + length, entries


# The live mappings mapped_tensors made: (first address, end address, the memmap, weakly: a mapping goes
# when the last tensor viewing it does).
_MAPPINGS: list[tuple[int, int, weakref.ref]] = []


def _remember(pages: np.memmap) -> None:
    _MAPPINGS[:] = [entry for entry in _MAPPINGS if entry[2]() is not None]
    _MAPPINGS.append((pages.ctypes.data, pages.ctypes.data + pages.nbytes, weakref.ref(pages)))


def release_pages(tensor: torch.Tensor) -> None:
    """Drop `tensor`'s pages from this process's resident memory if it views a mapping of mapped_tensors
    (anything else, e.g. a copy, is left alone). Its values stay readable: a read faults them back in."""
    if not tensor.numel():
        return
    first = tensor.data_ptr()
    end = first + tensor.untyped_storage().nbytes() - tensor.storage_offset() * tensor.element_size()
    for start, stop, ref in _MAPPINGS:
        pages = ref()
        if pages is not None and start <= first < stop:
            offset = (first - start) // mmap.PAGESIZE * mmap.PAGESIZE
            with contextlib.suppress(OSError, ValueError):  # an advice, not a need: the worst is the old footprint
                pages._mmap.madvise(mmap.MADV_DONTNEED, offset, min(end, stop) - start - offset)
            return


def mapped_tensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of `file` as a view of its copy-on-write mapping, in the file's order."""
    start, entries = header(file)
    size = file.stat().st_size
    pages = np.memmap(file, dtype=np.uint8, mode="c") if size > start else np.zeros(0, dtype=np.uint8)
    if isinstance(pages, np.memmap):
        _remember(pages)
    for name, entry in sorted(entries.items(), key=lambda item: item[1]["data_offsets"][0]):
        dtype = DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"tensor {name} has dtype {entry['dtype']}, which kaon does not read")
        shape = [int(d) for d in entry["shape"]]
        first, last = (start + int(offset) for offset in entry["data_offsets"])
        elements = int(np.prod(shape)) if shape else 1
        if last > size or last - first != elements * torch.empty((), dtype=dtype).element_size():
            raise ValueError(f"tensor {name}'s data ({first}..{last}) does not fit its shape or the file "
                             f"({size} bytes): truncated?")
        raw = torch.from_numpy(pages[first:last]) if last > first else torch.empty(0, dtype=torch.uint8)
        if raw.numel() and raw.data_ptr() % raw.new_empty((), dtype=dtype).element_size():
            yield name, raw.clone().view(dtype).reshape(shape)  # misaligned for its dtype: a copy, aligned
        else:
            yield name, raw.view(dtype).reshape(shape)
