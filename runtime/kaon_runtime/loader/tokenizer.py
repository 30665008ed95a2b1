"""Tokenizer and chat template, built from the model's own metadata."""
from __future__ import annotations

import json
from pathlib import Path

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers
from tokenizers.decoders import DecodeStream

from kaon_runtime.errors import InvalidRequestError, ModelLoadError

# Pre-tokenizer splits for byte-level vocabularies whose merges were learned on
# something other than GPT-2's own regex (GGUF names them in tokenizer.ggml.pre).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_PRE_TOKENIZER_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
_CONTROL, _USER_DEFINED = 3, 4  # GGUF token types


class Tokenizer:
    """Text <-> token ids, plus the model's chat template."""

    def __init__(self, backend: HFTokenizer, *, bos_token_id: int | None, eos_token_ids: list[int],
                 chat_template: str | None, add_bos: bool):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self.add_bos = add_bos and bos_token_id is not None
        self._template = _compile_template(chat_template) if chat_template else None
        self._dropped: dict[int, bool] = {}  # dropped_by_decode's answers
        self._special: frozenset[str] | None = None  # the special tokens' contents, read on first use

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        # Chat templates usually write BOS themselves; never add a second one.
        bos = self.bos_token_id
        if self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def dropped_by_decode(self, token_id: int) -> bool:
        """Whether decode (skipping special tokens) leaves `token_id` out before its decoder runs, so that
        it changes no text: an id with no token (outside the vocabulary), or a special token. This is the
        filter tokenizers' decode applies (by the token's content, as it does). Remembered per id."""
        dropped = self._dropped.get(token_id)
        if dropped is None:
            if self._special is None:
                self._special = frozenset(t.content for t in self.backend.get_added_tokens_decoder().values()
                                          if t.special)
            token = self.backend.id_to_token(token_id)
            dropped = self._dropped[token_id] = token is None or token in self._special
        return dropped

    def token_to_str(self, token_id: int) -> str:
        return self.backend.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """The prompt for `messages`; `tools` (OpenAI tool objects) reach the template as HF's
        apply_chat_template(tools=...) passes them: a variable that is undefined when there are none."""
        if self._template is None:
            raise InvalidRequestError("this model has no chat template; use a plain completion prompt")
        bos = self.backend.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.backend.id_to_token(self.eos_token_id) if self.eos_token_id is not None else ""
        extra = {"tools": tools} if tools else {}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=bos, eos_token=eos, **extra)
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"chat template rejected the messages: {exc}") from exc

    # ---- construction -------------------------------------------------------------

    @classmethod
    def bytes_only(cls, bos_token_id: int | None, eos_token_id: int | None) -> Tokenizer:
        """One token per byte and no merges, for random-weight models: their text is never read,
        and this needs no vocabulary file. Ids past 255 decode to nothing."""
        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        backend = HFTokenizer(models.BPE({symbol: i for i, symbol in enumerate(alphabet)}, [], fuse_unk=False))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        return cls(backend, bos_token_id=bos_token_id, eos_token_ids=_unique([eos_token_id]), chat_template=None,
                   add_bos=False)

    @classmethod
    def from_gguf_fields(cls, fields: dict) -> Tokenizer:
        """Build from GGUF `tokenizer.ggml.*` metadata (byte-level BPE vocabularies)."""
        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelLoadError(f"GGUF tokenizer type {kind!r} is not supported yet (only byte-level BPE 'gpt2'); "
                                 "load the model's HF directory instead")
        tokens = fields["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
        backend = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
        split = _PRE_TOKENIZER_SPLITS.get(fields.get("tokenizer.ggml.pre", ""))
        if split is None:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        backend.decoder = decoders.ByteLevel()
        types = fields.get("tokenizer.ggml.token_type") or []
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                    for t, k in zip(tokens, types) if k == _CONTROL])
        backend.add_tokens([AddedToken(t, normalized=False, special=False)
                            for t, k in zip(tokens, types) if k == _USER_DEFINED])
        eos = fields.get("tokenizer.ggml.eos_token_id")
        eot = fields.get("tokenizer.ggml.eot_token_id")
        # Byte-level vocabularies come from HF tokenizers that add no BOS of their own
        # (llama.cpp's converter sets add_bos_token regardless); follow the original.
        return cls(backend, bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
                   eos_token_ids=_unique([eos, eot]), chat_template=fields.get("tokenizer.chat_template"),
                   add_bos=False)

    @classmethod
    def from_hf_dir(cls, path: Path) -> Tokenizer:
        if not (path / "tokenizer.json").is_file():
            raise ModelLoadError(f"{path} has no tokenizer.json")
        backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")
        model_config = _read_json(path / "config.json")

        def token_id(value):
            if isinstance(value, dict):
                value = value.get("content")
            return backend.token_to_id(value) if isinstance(value, str) else None

        eos = generation.get("eos_token_id", model_config.get("eos_token_id"))
        eos_ids = eos if isinstance(eos, list) else [eos]
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        # tokenizer.json's post-processor already adds BOS where the model wants one.
        bos = token_id(config.get("bos_token"))
        if bos is None:
            bos = model_config.get("bos_token_id")
        return cls(backend, bos_token_id=bos,
                   eos_token_ids=_unique(eos_ids + [token_id(config.get("eos_token"))]),
                   chat_template=template, add_bos=False)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, emitting only complete characters.

    Byte-level tokens can split a UTF-8 character; decoding the tail from a small
    window of earlier tokens and holding back a trailing U+FFFD keeps the text exact.

    A token `decode` drops before its decoder runs (an id outside the vocabulary, a special token: the
    tokenizers library filters them out first) changes no window's text, so it is not added to the
    window: it would only lengthen it. Each new token then costs two decodes of a few tokens, where a run
    of such tokens (random:// models' ids past 255, which the byte tokenizer has no entry for) would
    make each decode as long as the run, O(n) per token.

    Where the tokenizer's decoder is ByteLevel, the same window algorithm runs in Rust (tokenizers'
    DecodeStream: one call per token, the prefix's decode kept, no list crossing into native code; ~3x
    less CPU per token here). It is handed over only where its state equals this one's (see `_hand_over`),
    and any step it refuses (its InvalidPrefix error) goes back to the Python window for good, so the
    pieces and text are the Python algorithm's exactly (tests/unit/runtime/loader/test_tokenizer.py).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self._stream: DecodeStream | None = None
        self._streamable = isinstance(tokenizer.backend.decoder, decoders.ByteLevel)
        if self._streamable:
            self._hand_over(tokenizer.decode(self.ids))

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        tokenizer = self.tokenizer
        if tokenizer.dropped_by_decode(token_id):
            return ""
        ids = self.ids
        ids.append(token_id)
        stream = self._stream
        if stream is not None:
            try:
                new = stream.step(tokenizer.backend, token_id)
            except Exception:  # noqa: BLE001 - the binding raises plain Exception (InvalidPrefix): the window takes over
                self._stream, self._streamable = None, False
            else:
                if new is None:
                    return ""
                self.prefix_offset, self.read_offset = self.read_offset, len(ids)
                self.text += new
                return new
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        new = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += new
        if self._streamable:
            self._hand_over(self.tokenizer.decode(self.ids[self.prefix_offset:]))
        return new

    def _hand_over(self, prefix: str) -> None:
        """Start the Rust stream where its state equals this one's: just after an emission (or at the start),
        when the window is ids[prefix_offset:] and the prefix is the decode of all of it. DecodeStream(ids)
        takes that decode as its prefix unless it is empty or ends in U+FFFD (then it would emit the window's
        own text), so only a prefix with neither is handed over; until then the Python window goes on."""
        if prefix and not prefix.endswith("\ufffd"):
            self._stream = DecodeStream(ids=self.ids[self.prefix_offset:], skip_special_tokens=True)


def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelLoadError(f"the model's chat template does not parse: {exc}") from exc


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _unique(ids) -> list[int]:
    out = []
    for i in ids:
        if isinstance(i, int) and i not in out:
            out.append(i)
    return out
