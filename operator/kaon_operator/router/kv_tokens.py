"""A request's prompt as the engine will tokenize it, for the kv-aware strategy: the tokenizer
comes from an engine pod (its GET /kaon/tokenizer: the tokenizers library's JSON and the chat
template), and it is used the way the engine uses it (kaon_runtime/loader/tokenizer.py, which the
operator may not import): the chat template rendered in a sandbox, no special tokens added but a
BOS the template did not write.

A prompt the router renders differently from the engine (tools, content parts it does not know)
only finds a shorter prefix: it is routed on less, never served wrong.
"""
from __future__ import annotations

from collections.abc import Mapping

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer

_TOKEN_ID_LIMIT = 1 << 32  # kv_index.next_key packs each token id in 4 bytes


class PromptTokenizer:
    def __init__(self, info: Mapping):
        self.backend = Tokenizer.from_str(info["tokenizer"])
        self.bos_token_id = info.get("bos_token_id")
        eos = info.get("eos_token_ids") or []
        self.eos_token_id = eos[0] if eos else None
        self.add_bos = bool(info.get("add_bos")) and self.bos_token_id is not None
        template = info.get("chat_template")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message):
            raise jinja2.TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        self._template = env.from_string(template) if template else None

    def encode(self, text: str) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        bos = self.bos_token_id
        if self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    def prompt_ids(self, path: str, payload: Mapping) -> list[int] | None:
        """The prompt's token ids, or None when the router cannot tell (no prompt, a template error)."""
        try:
            if path.endswith("/chat/completions"):
                messages = payload.get("messages")
                if self._template is None or not isinstance(messages, list) or not messages:
                    return None
                return self._chat_ids(messages)
            if path.endswith("/completions"):
                prompt = payload.get("prompt")
                if isinstance(prompt, list) and len(prompt) == 1:
                    prompt = prompt[0]
                if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                    # Ids no vocabulary has (negative, past 32 bits: the index packs each in 4 bytes) are the
                    # engine's to refuse with its 400: the router cannot tell where such a prompt lives.
                    return list(prompt) if all(0 <= t < _TOKEN_ID_LIMIT for t in prompt) else None
                if isinstance(prompt, str) and prompt:
                    return self.encode(prompt)
        except (jinja2.TemplateError, TypeError, ValueError):
            return None
        return None

    def preamble_length(self, path: str, payload: Mapping, ids: list[int]) -> int:
        """How many leading tokens of a chat prompt (`ids`, from prompt_ids) are its preamble: what
        the template writes before the first user message's text (the system prompt, its own
        default one where none is given). Every conversation with that system prompt shares them,
        so they tell nothing of where a conversation lives. Found as the common prefix with the
        preamble followed by an empty user message, so that no template's layout is assumed.
        0 for a completion, or when the router cannot tell."""
        messages = payload.get("messages") if path.endswith("/chat/completions") else None
        if self._template is None or not isinstance(messages, list):
            return 0
        first_user = next((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"), None)
        if first_user is None:
            return 0
        try:
            preamble = self._chat_ids([*messages[:first_user], {"role": "user", "content": ""}])
        except (jinja2.TemplateError, TypeError, ValueError):
            return 0
        common = 0
        for mine, theirs in zip(preamble, ids):
            if mine != theirs:
                break
            common += 1
        return common

    def _chat_ids(self, messages: list) -> list[int]:
        if self._template is None:
            raise ValueError("no chat template")
        bos = self.backend.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.backend.id_to_token(self.eos_token_id) if self.eos_token_id is not None else ""
        text = self._template.render(messages=[_plain(m) for m in messages], add_generation_prompt=True,
                                     bos_token=bos, eos_token=eos)
        return self.encode(text)


def _plain(message) -> dict:
    """A chat message as the template reads it: text parts joined."""
    if not isinstance(message, dict):
        return {"role": "user", "content": str(message)}
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return {**message, "content": content if content is not None else ""}
