"""Offline facade: LLM(model=...).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import cast

from tqdm.auto import tqdm

from kaon_runtime.config import DEFAULT_MODEL, EngineConfig
from kaon_runtime.engine.llm_engine import LLMEngine
from kaon_runtime.engine.outputs import RequestOutput
from kaon_runtime.engine.sleep import EngineAsleepError, Sleep, put_to_sleep, wake_up
from kaon_runtime.errors import InvalidRequestError
from kaon_runtime.lora.request import LoRARequest
from kaon_runtime.sampling import SamplingParams

Prompt = str | list[int] | dict


def prompt_batch(prompts: Prompt | Sequence[Prompt]) -> list[str | list[int]]:
    """generate's prompts as a list of text or token id prompts. One prompt (text, token ids, or vLLM's
    {"prompt": ...} / {"prompt_token_ids": ...}) or a list of them, as vLLM's LLM.generate takes."""
    one = isinstance(prompts, (str, dict)) or (bool(prompts) and isinstance(prompts[0], int))
    batch = [cast(Prompt, prompts)] if one else cast(Sequence[Prompt], prompts)
    return [_one_prompt(p) for p in batch]


def _one_prompt(prompt: Prompt) -> str | list[int]:
    if not isinstance(prompt, dict):
        return prompt
    if "prompt_token_ids" in prompt:  # vLLM's TokensPrompt (its "prompt" key, if any, is only a label)
        return list(prompt["prompt_token_ids"])
    if "prompt" in prompt:  # vLLM's TextPrompt
        return prompt["prompt"]
    raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")


class LLM:
    """Load a model once, then generate for batches of prompts with continuous batching.

    An LLM holds worker processes (tensor or pipeline parallelism), their process groups and ports, and
    the model's memory: `close()`, a `with LLM(...) as llm:` block, or the object's garbage collection
    gives them all back, so any number of LLMs, of any settings, can come and go in one process.
    """

    def __init__(self, model: str = DEFAULT_MODEL, show_progress: bool = True, adapters: dict[str, str] | None = None,
                 enable_sleep_mode: bool = False, enable_lora: bool = False, **engine_options):
        """`adapters`: LoRA adapters (PEFT directories) by name, for generate's `adapter`. vLLM's
        `enable_sleep_mode` allows sleep() / wake_up(); its `enable_lora` turns adapters on (one slot
        unless `max_loras` says more) for generate's `lora_request`."""
        if adapters:
            engine_options["lora_modules"] = {**engine_options.get("lora_modules", {}), **adapters}
        if enable_lora and not engine_options.get("max_loras") and not engine_options.get("lora_modules"):
            engine_options["max_loras"] = 1  # vLLM's default max_loras
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options), show_progress=show_progress)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        self._sleep_mode = enable_sleep_mode
        self._slept: Sleep | None = None
        self._lora_ids: dict[int, LoRARequest] = {}  # the LoRARequests seen, by vLLM's int id
        # generate() from several threads: the engine steps under this lock, one step at a time, and each
        # finished output waits here for the call that asked for it (the threads' requests batch together).
        self._lock = threading.Lock()
        self._finished: dict[str, RequestOutput] = {}

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, adapter: str | list[str | None] | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None, *,
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Outputs come back in prompt order. A prompt is text, a list of token ids, or vLLM's dict forms
        ({"prompt": text} or {"prompt_token_ids": ids}). `sampling_params` (vLLM's name; `params` is kept
        for kaon's earlier callers): one for every prompt or one per prompt. `adapter`: the LoRA adapter's
        name for every prompt, or a list with one per prompt (None: the base model); `lora_request`: vLLM's
        form of the same (a LoRARequest, or a list of them), registered by its name on first use.
        While asleep (sleep()), raises EngineAsleepError: call wake_up() first."""
        batch = prompt_batch(prompts)
        if params is not None and sampling_params is not None:
            raise TypeError("pass sampling_params or params, not both")
        params = sampling_params if sampling_params is not None else params
        params = params if params is not None else SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(batch)
        if len(per_prompt) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(per_prompt)} sampling params")
        if lora_request is not None and adapter is not None:
            raise TypeError("pass adapter or lora_request, not both")
        with self._lock:
            ids = self._add(batch, per_prompt, adapter, lora_request)
        try:
            with tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm or len(ids) < 2) as bar:
                done = 0
                while done < len(ids):
                    with self._lock:
                        if not all(i in self._finished for i in ids):  # else another thread's step finished them
                            for output in self.engine.step(only_finished=True):  # the last output is the one kept
                                if output.finished:
                                    self._finished[output.request_id] = output
                        now_done = sum(i in self._finished for i in ids)
                    bar.update(now_done - done)
                    done = now_done
        finally:  # returning or interrupted (Ctrl-C, a dead engine): this call's requests leave the engine
            with self._lock:
                found = [self._finished.pop(i, None) for i in ids]
                for request_id, kept in zip(ids, found):
                    if kept is None and not self.engine.closed:  # closed: nothing is left to abort
                        self.engine.abort_request(request_id)
        return cast(list[RequestOutput], found)

    def _add(self, batch: list[str | list[int]], per_prompt: list[SamplingParams],
             adapter: str | list[str | None] | None,
             lora_request: LoRARequest | list[LoRARequest | None] | None) -> list[str]:
        """Add one engine request a prompt (all or none: a bad one aborts those added before it); their ids."""
        if self._slept is not None:
            raise EngineAsleepError("the engine is asleep (LLM.sleep): call wake_up() before generating")
        if lora_request is not None:
            adapter = self._adapter_names(lora_request)
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
        return ids

    def _adapter_names(self, lora_request: LoRARequest | list[LoRARequest | None]) -> str | list[str | None] | None:
        """kaon's adapter names for vLLM's LoRARequests, registering each new one's directory under its name."""
        requests = lora_request if isinstance(lora_request, list) else [lora_request]
        for r in requests:
            if r is None:
                continue
            if not isinstance(r, LoRARequest):
                raise TypeError(f"lora_request must be a LoRARequest, got {type(r).__name__}")
            known = self._lora_ids.get(r.lora_int_id)
            if known is not None and (known.lora_name, known.lora_path) != (r.lora_name, r.lora_path):
                raise InvalidRequestError(f"lora_int_id {r.lora_int_id} is already {known.lora_name!r} "
                                          f"({known.lora_path}); give {r.lora_name!r} another id")
            if known is None:
                registered = dict(self.engine.lora_adapters())
                if r.lora_name not in registered:
                    self.engine.add_lora(r.lora_name, r.lora_path)
                elif registered[r.lora_name] != r.lora_path:
                    raise InvalidRequestError(f"adapter {r.lora_name!r} is {registered[r.lora_name]}, "
                                              f"not {r.lora_path}")
                self._lora_ids[r.lora_int_id] = r
        names = [None if r is None else r.lora_name for r in requests]
        return names if isinstance(lora_request, list) else names[0]

    # ---- sleep mode (vLLM's LLM.sleep / wake_up; engine/sleep.py says what each level frees) ----

    def sleep(self, level: int = 1) -> None:
        """Free the KV pool (level 1; on a GPU the weights go to host memory) or the weights too (level 2:
        written to a file first, read back on wake). Needs LLM(..., enable_sleep_mode=True), as vLLM's."""
        if not self._sleep_mode:
            raise InvalidRequestError("sleep mode is not enabled: create the LLM with enable_sleep_mode=True")
        with self._lock:  # not in the middle of another thread's step
            if self._slept is not None:
                raise InvalidRequestError(f"already asleep (level {self._slept.level}): call wake_up() first")
            self._slept = put_to_sleep(self.engine, level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Put back what sleep() freed. vLLM's `tags` ("weights", "kv_cache") wake a part; here the engine
        wakes whole at the first call (so vLLM's wake_up(["weights"]) then wake_up(["kv_cache"]) runs as
        written: the second finds it awake). Awake already: nothing to do."""
        unknown = set(tags or ()) - {"weights", "kv_cache"}
        if unknown:
            raise InvalidRequestError(f"wake_up: unknown tags {sorted(unknown)}; vLLM's are 'weights' and 'kv_cache'")
        with self._lock:
            if self._slept is not None:
                wake_up(self.engine, self._slept)
                self._slept = None

    def is_sleeping(self) -> bool:
        """Whether sleep() was called without a wake_up() since (vLLM's LLMEngine.is_sleeping)."""
        return self._slept is not None

    def close(self) -> None:
        """Stop the engine's workers, if any, and release its process groups, ports and memory. A generate()
        in another thread finishes its step first, then raises EngineDeadError."""
        with self._lock:
            self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request: LoRARequest | list[LoRARequest | None] | None = None, *,
             params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation (one, or a list of them), then generate.
        `sampling_params` and `lora_request` as in generate (vLLM's names; `params` kept for earlier callers)."""
        one = bool(messages) and isinstance(messages[0], dict)
        batch: list[list[dict]] = [messages] if one else messages  # type: ignore[list-item,assignment]
        prompts: list[Prompt] = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in batch]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request, params=params)

    def get_tokenizer(self):
        """The model's tokenizer (vLLM's name): encode, decode, apply_chat_template."""
        return self.tokenizer

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
