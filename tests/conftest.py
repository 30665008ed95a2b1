"""Shared fixtures: the embedded model, loaded once by kaon and once by HF transformers."""
from __future__ import annotations

import functools
import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter; it must be chosen before any kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`make test` runs tests/unit on two workers): one compute thread per worker (torch's,
# and the C kernels', which use as many as torch), so two workers on two cores do not run four.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

from kaon_runtime.kernels import cpu_decode
from kaon_runtime.loader import resolve_model
from support import MODEL

# transformers asks gguf for its tensor-name map once per submodule of the model (397 times for SmolLM2, each
# built anew from every architecture's table: ~40% of an HF GGUF load); it is a pure function of (architecture,
# layers), so it is built once. gguf's own reader is left as it is: the HF references must not read the file
# through kaon's code. Same results: the bundled model's HF state dict and tokenizer came out equal (2026-12-01).
try:
    import gguf
except ImportError:  # the GGUF tests skip without it
    pass
else:
    gguf.get_tensor_name_map = functools.cache(gguf.get_tensor_name_map)


@pytest.fixture(scope="session")
def gguf_path():
    return resolve_model(MODEL)


@pytest.fixture(scope="session")
def llm():
    from kaon_runtime import LLM
    return LLM(MODEL, show_progress=False, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def hf_model(gguf_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


# One `kaon serve --task embed` of a tiny Qwen3 for the session (see support/embed_model.py);
# a real Kubernetes control plane and the operator under test (see support/k8s.py).
from support.embed_model import embed_server  # noqa: E402, F401
from support.k8s import control_plane, crd, namespace, operator, operator_kubeconfig  # noqa: E402, F401

# Triton's interpreter with a tl.dot whose rows do not depend on each other, as on a GPU (support/row_dot.py).
from support.row_dot import row_dot  # noqa: E402, F401

# One `kaon serve` of the bundled model with the default flags for the session (see support/server.py).
from support.server import default_server  # noqa: E402, F401

# Model sources: the stand-in HF hub and a real MinIO (see conftest_sources.py).
from support.sources import hf_hub, minio, tiny_llama_dir  # noqa: E402, F401

# A tiny random Llama for the kernel and backend tests (see support/tiny_llama.py).
from support.tiny_llama import tiny_llama  # noqa: E402, F401


@pytest.fixture
def float_kernels(monkeypatch):
    """kaon's float32 reference kernels: dequantized weights times float activations, no fused C step."""
    monkeypatch.setenv("KAON_QUANT_KERNEL", "torch")
    monkeypatch.setenv("KAON_CPU_DECODE", "off")
    cpu_decode.library.cache_clear()
    yield
    cpu_decode.library.cache_clear()
