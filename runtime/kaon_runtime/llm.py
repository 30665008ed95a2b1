"""Offline facade: LLM(model=...).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

import itertools

from tqdm.auto import tqdm

from kaon_runtime.config import DEFAULT_MODEL, EngineConfig
from kaon_runtime.engine.llm_engine import LLMEngine
from kaon_runtime.engine.outputs import RequestOutput
from kaon_runtime.sampling import SamplingParams


class LLM:
    """Load a model once, then generate for batches of prompts with continuous batching.

    An LLM holds worker processes (tensor or pipeline parallelism), their process groups and ports, and
    the model's memory: `close()`, a `with LLM(...) as llm:` block, or the object's garbage collection
    gives them all back, so any number of LLMs, of any settings, can come and go in one process.
    """

    def __init__(self, model: str = DEFAULT_MODEL, show_progress: bool = True, adapters: dict[str, str] | None = None,
                 **engine_options):
        """`adapters`: LoRA adapters (PEFT directories) by name, for generate's `adapter`."""
        if adapters:
            engine_options["lora_modules"] = {**engine_options.get("lora_modules", {}), **adapters}
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options), show_progress=show_progress)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, adapter: str | list[str | None] | None = None) -> list[RequestOutput]:
        """Outputs come back in prompt order. Prompts are text or token id lists. `adapter`: the LoRA
        adapter's name for every prompt, or a list with one per prompt (None: the base model)."""
        one = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        batch: list[str | list[int]] = [prompts] if one else list(prompts)  # type: ignore[list-item]
        params = params if params is not None else SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(batch)
        if len(per_prompt) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(per_prompt)} sampling params")
        adapters = adapter if isinstance(adapter, list) else [adapter] * len(batch)
        if len(adapters) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(adapters)} adapters")
        ids: list[str] = []
        try:
            for prompt, p, name in zip(batch, per_prompt, adapters):
                ids.append(str(next(self._ids)))
                self.engine.add_request(ids[-1], prompt, p, adapter=name)
        except Exception:
            for request_id in ids[:-1]:
                self.engine.abort_request(request_id)
            raise
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm or len(ids) < 2) as bar:
            while len(done) < len(ids):
                for output in self.engine.step(only_finished=True):  # the last output is the one kept
                    if output.finished:
                        done[output.request_id] = output
                        bar.update(1)
        return [done[i] for i in ids]

    def close(self) -> None:
        """Stop the engine's workers, if any, and release its process groups, ports and memory."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def chat(self, conversations: list[dict] | list[list[dict]], params: SamplingParams | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        one = bool(conversations) and isinstance(conversations[0], dict)
        batch: list[list[dict]] = [conversations] if one else conversations  # type: ignore[list-item,assignment]
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in batch]
        return self.generate(prompts, params, use_tqdm)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
