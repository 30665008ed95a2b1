"""vLLM's LoRARequest, so that `LLM.generate(..., lora_request=LoRARequest(name, int_id, path))` runs here as
written for vLLM (`from vllm.lora.request import LoRARequest` becomes `from kaon_runtime.lora.request import
LoRARequest`). kaon itself names adapters (LLM's `adapters=`, generate's `adapter=`); the LLM registers a
request's adapter under its name the first time it sees it (kaon_runtime.llm)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter directory, by vLLM's field names. Equal (and hashed) by name, as vLLM's."""

    lora_name: str
    lora_int_id: int = field(compare=False)
    lora_path: str = field(default="", compare=False)
    lora_local_path: str | None = field(default=None, compare=False)  # vLLM's deprecated spelling of the path
    long_lora_max_len: int | None = field(default=None, compare=False)  # not supported: must stay None
    base_model_name: str | None = field(default=None, compare=False)

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")  # vLLM's check and words
        if self.long_lora_max_len is not None:
            raise ValueError("long_lora_max_len is not supported")
        if not self.lora_path and self.lora_local_path:
            object.__setattr__(self, "lora_path", self.lora_local_path)
        if not self.lora_path:
            raise ValueError("lora_path cannot be empty")  # vLLM asserts the same

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def local_path(self) -> str:
        return self.lora_path
