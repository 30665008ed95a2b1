"""A step plan's lists as tensors, at a host cost that does not grow with each sequence's length.

torch.tensor reads a list of Python ints element by element (~0.1-0.4 us each on a Zen 2); numpy reads
the same list an order of magnitude faster, and torch.from_numpy shares its memory. The decode rows'
block tables are the large part: 256 sequences of 2,048 tokens in 16-token blocks are 32,768 ids, over
10 ms a step through torch.tensor. A sequence's table only grows between its decode steps (one block
every block_size tokens), so DecodeTables keeps each decoding sequence's row in one array from step
to step, writes only the blocks it gained, and gathers the step's rows in one indexing copy.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def long_tensor(values: Sequence, device: torch.device) -> torch.Tensor:
    """torch.tensor(values, dtype=torch.long, device=device) (a list, or a rectangle of lists), through numpy."""
    cpu = torch.from_numpy(np.asarray(values, dtype=np.int64))
    return cpu if device.type == "cpu" else cpu.to(device)


class DecodeTables:
    """Block tables of the decode rows, padded with block 0 past each table's end, as padded_decode_tables
    gives them, kept between steps by sequence id.

    Each sequence that decoded last step has a row here holding the table it had then. A row is
    rewritten where its table changed other than by growing (a preemption gave its blocks back, a
    truncation took some), and dropped once its sequence is not among a step's decodes (finished,
    preempted, or in a prefill chunk): it is written in full when it decodes again."""

    def __init__(self) -> None:
        self._store = np.zeros((0, 0), dtype=np.int64)
        self._rows: dict[int, tuple[int, list[int]]] = {}  # seq id -> (row in _store, the table written there)
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self._rows)

    def gather(self, seq_ids: list[int], tables: list[list[int]]) -> torch.Tensor:
        """The step's tables [len(tables), the widest], row i the table of sequence seq_ids[i]: a new CPU tensor."""
        widest = max(map(len, tables))
        self._fit(len(seq_ids), widest)
        store, known, rows = self._store, self._rows, []
        kept: dict[int, tuple[int, list[int]]] = {}
        for seq_id, table in zip(seq_ids, tables):
            entry = known.pop(seq_id, None)
            if entry is None:
                row = self._free.pop()
                store[row, :len(table)] = table
            else:
                row, old = entry
                if table != old:
                    if len(table) >= len(old) and table[:len(old)] == old:
                        store[row, len(old):len(table)] = table[len(old):]
                    else:
                        store[row, :len(table)] = table
                        store[row, len(table):len(old)] = 0
            kept[seq_id] = (row, table)
            rows.append(row)
        for row, old in known.values():  # not decoding this step: its row is free again, zeroed for the next
            store[row, :len(old)] = 0
            self._free.append(row)
        self._rows = kept
        return torch.from_numpy(store[rows, :widest])  # fancy indexing copies: the store changes next step

    def _fit(self, num_rows: int, widest: int) -> None:
        """Room for num_rows rows more than are kept (the worst case: all new) and tables `widest` long."""
        height, width = self._store.shape
        need = len(self._rows) + num_rows
        if need <= height and widest <= width:
            return
        grown = np.zeros((max(need, 2 * height), max(widest, 2 * width if widest > width else width)), dtype=np.int64)
        grown[:height, :width] = self._store
        self._free += range(height, grown.shape[0])
        self._store = grown
