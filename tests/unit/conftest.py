"""tests/unit's order on pytest-xdist's two workers: the longest files first.

`--dist loadfile` hands out whole files, one at a time to whichever worker is free, in the order
of the collection (the Makefile turns off xdist's own reorder, which put files with the most tests
first: the long model comparisons have few tests, so they started last and one worker ran a
long file alone at the end: 190 s of the unit stage on a 2-vCPU Zen 2, 2026-11-30, load 4-10).
Longest first, the short files fill both workers' ends. The list is measured (the unit stage's
per-file times, docs/testing.md); a file missing from it only runs in its usual place.
"""
from __future__ import annotations

import pytest

# Longest first (worker seconds, make test's unit stage on a 2-vCPU Zen 2, 2026-11-30, under load 4-10)
LONGEST_FIRST = (
    "runtime/test_correctness.py",
    "runtime/loader/test_gguf_models.py",
    "runtime/loader/test_gguf_families.py",
    "runtime/quant/test_quantized_checkpoints.py",
    "runtime/quant/test_quantized_experts.py",
    "runtime/engine/test_stop_strings.py",
    "runtime/structured/test_structured_engine.py",
    "runtime/kernels/test_kernels_compile.py",
    "runtime/loader/test_architectures.py",
    "runtime/engine/test_spec_decode.py",
    "runtime/engine/test_load_memory.py",
    "runtime/kernels/test_paged_attention.py",
    "runtime/engine/test_batch_invariance.py",
    "runtime/quant/test_quant.py",
    "runtime/server/test_embeddings_off_loop.py",
)


def file_rank(path: str, counts: dict[str, int]) -> tuple[int, int]:
    """Where a file's tests go: the listed files in the list's order, then the others by most tests
    first (xdist's own order, which the Makefile turns off so that this one holds)."""
    listed = next((i for i, name in enumerate(LONGEST_FIRST) if path.endswith(name)), len(LONGEST_FIRST))
    return listed, -counts[path]


@pytest.hookimpl(trylast=True)  # after the -m selection and the other hooks' reorders
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    counts: dict[str, int] = {}
    for item in items:
        counts[item.nodeid.split("::")[0]] = counts.get(item.nodeid.split("::")[0], 0) + 1
    items.sort(key=lambda item: file_rank(item.nodeid.split("::")[0], counts))  # stable: a file's order kept
