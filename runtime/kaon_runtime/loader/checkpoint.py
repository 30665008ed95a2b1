"""The Checkpoint type: what a model source (GGUF file, HF directory, random weights) gives the model runner.

Opening one is loader/opener.py's job; each format has its own module (gguf_file.py, hf_dir.py)."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from kaon_runtime.config import ModelConfig
from kaon_runtime.loader.tokenizer import Tokenizer


@dataclass(slots=True)
class Checkpoint:
    """What the model runner needs; `weights()` yields (HF parameter name, tensor) lazily."""

    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    num_tensors: int
    weights: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    # HF directories quantized by their publisher (AWQ, GPTQ, compressed-tensors): config.json's
    # quantization_config, and every tensor's name (cheap: the safetensors headers).
    quantization_config: dict | None = None
    tensor_names: Callable[[], list[str]] | None = None
    # Each stored tensor's (elements, bytes in the file, whether it is stored quantized: integer or FP8 values,
    # or GGUF blocks), from the headers alone: what the engine's memory check reads (engine/memory_fit.py).
    tensor_sizes: Callable[[], list[tuple[int, int, bool]]] | None = None
