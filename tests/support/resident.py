"""Resident memory of one mapping of this process (/proc/self/smaps), for the load-memory tests (issue 49 §3)."""
from __future__ import annotations

import torch


def mapping_resident_bytes(tensor: torch.Tensor) -> int:
    """Resident bytes of the mapping that holds `tensor`'s first byte (its /proc/self/smaps entry's Rss)."""
    address = tensor.data_ptr()
    with open("/proc/self/smaps") as smaps:
        lines = smaps.read().splitlines()
    for i, line in enumerate(lines):
        span = line.split()[0]
        if "-" in span and all(c in "0123456789abcdef-" for c in span):
            first, end = (int(v, 16) for v in span.split("-"))
            if first <= address < end:
                rss = next(entry for entry in lines[i + 1:] if entry.startswith("Rss:"))
                return int(rss.split()[1]) * 1024
    raise AssertionError("no mapping holds the tensor")
