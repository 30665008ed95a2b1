"""LoRA adapters in vLLM's offline API shape (LoRARequest); the adapters themselves: engine/lora_pool.py."""
from kaon_runtime.lora.request import LoRARequest

__all__ = ["LoRARequest"]
