"""Model loading: resolve a model id, read weights and tokenizer (GGUF, HF directory or random://)."""
from kaon_runtime.loader.checkpoint import Checkpoint
from kaon_runtime.loader.opener import load_checkpoint, open_checkpoint
from kaon_runtime.loader.resolve import resolve_model

__all__ = ["Checkpoint", "load_checkpoint", "open_checkpoint", "resolve_model"]
