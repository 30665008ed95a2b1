"""Compiling a `GrammarSpec` for one tokenizer, once: xgrammar's compiler behind a cache keyed by spec.

xgrammar turns a grammar into per-state token masks ahead of time (most tokens' fate is
decided once, at compile time), which is what makes each step's mask cheap. Compiling costs
milliseconds to a second for a large schema, so compiled grammars are kept, least recently
used evicted first. Compilation runs wherever `compile` is called: the server calls it from
its grammar threads, never on the engine loop, with a deadline: then it runs in a forked child
(compile_worker.py), killed at the deadline so that its CPU and threads stop with the request.
Without one (LLM.generate) it runs on the calling thread. Anything xgrammar cannot compile becomes an
InvalidRequestError naming the problem (the server's 400).
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

import xgrammar as xgr

from kaon_runtime.errors import InvalidRequestError
from kaon_runtime.loader.tokenizer import Tokenizer
from kaon_runtime.structured.compile_worker import CompileFailed, CompileTimeout, compile_apart, compile_spec
from kaon_runtime.structured.spec import GrammarSpec

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept; a large schema's takes a few MB
_NOUNS = {"json_schema": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
          "choice": "choice list", "grammar": "EBNF grammar", "structural_tag": "tool-call grammar"}


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> xgr.TokenizerInfo:
    """xgrammar's view of our tokenizer: every token's text, how it encodes bytes, the stop tokens.

    `vocab_size` is the model's (the logits' width), which can exceed the tokenizer's: padding rows
    are never allowed.
    """
    backend = tokenizer.backend
    vocab = [""] * vocab_size
    for token, index in backend.get_vocab(with_added_tokens=True).items():
        if index < vocab_size:
            vocab[index] = token
    return xgr.TokenizerInfo(vocab, vocab_type=_vocab_type(backend.to_str(), vocab), vocab_size=vocab_size,
                             stop_token_ids=list(tokenizer.eos_token_ids) or None,
                             add_prefix_space=_adds_prefix_space(backend.to_str()))


def _vocab_type(backend_json: str, vocab: list[str]) -> xgr.VocabType:
    """Byte-level BPE (GPT-2's byte alphabet), SentencePiece byte fallback (<0x0A>), or raw text."""
    if '"ByteLevel"' in backend_json:
        return xgr.VocabType.BYTE_LEVEL
    if "<0x0A>" in vocab:
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


def _adds_prefix_space(backend_json: str) -> bool:
    # SentencePiece-style tokenizers prepend "▁" to the text; byte-level ones here never do.
    config = json.loads(backend_json)
    parts = [config.get("normalizer") or {}, config.get("pre_tokenizer") or {}]
    for part in parts:
        for step in part.get("normalizers", part.get("pretokenizers", [part])) or [part]:
            if step.get("type") == "Prepend" or (step.get("type") == "Metaspace"
                                                 and step.get("prepend_scheme", "always") != "never"):
                return True
    return False


class GrammarCache:
    """Compiled grammars for one tokenizer, by spec. Safe to call from several threads."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_entries: int = DEFAULT_CACHE_SIZE):
        self.info = tokenizer_info(tokenizer, vocab_size)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=4, cache_enabled=False)
        self._compiled: OrderedDict[GrammarSpec, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.max_entries = max_entries
        self.hits = self.misses = 0

    def compile(self, spec: GrammarSpec, timeout_s: float | None = None) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec`; raises InvalidRequestError for one that cannot be compiled, or (with
        `timeout_s`) not within that many seconds: then its process is killed, and its CPU and threads are free."""
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
                self.hits += 1
                return compiled
            self.misses += 1
        # outside the lock: a slow schema does not hold up cached ones
        compiled = self._compile(spec) if timeout_s is None else self._compile_apart(spec, timeout_s)
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > self.max_entries:
                self._compiled.popitem(last=False)
        return compiled

    def __len__(self) -> int:
        return len(self._compiled)

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        try:
            compiled = compile_spec(self._compiler, spec.kind, spec.source)
        except Exception as exc:  # noqa: BLE001  whatever stops a client's grammar compiling is a 400, never a 500
            raise InvalidRequestError(f"the {_NOUNS[spec.kind]} cannot be compiled: "
                                      f"{_first_line(exc)}") from None
        if compiled is None:
            raise InvalidRequestError(f"unknown grammar kind {spec.kind!r}")
        return compiled

    def _compile_apart(self, spec: GrammarSpec, timeout_s: float) -> xgr.CompiledGrammar:
        """`spec` compiled in a forked child, killed if it runs past `timeout_s`."""
        try:
            return compile_apart(self.info, spec.kind, spec.source, timeout_s)
        except CompileTimeout:
            raise InvalidRequestError(f"the grammar did not compile within {timeout_s:g} s; send a smaller "
                                      "one") from None
        except CompileFailed as exc:
            raise InvalidRequestError(f"the {_NOUNS.get(spec.kind, 'grammar')} cannot be compiled: "
                                      f"{_first_line(exc)}") from None


def _first_line(exc: Exception) -> str:
    """The message without xgrammar's "[hh:mm:ss] /project/cpp/file.cc:83: " prefix."""
    text = (str(exc).strip() or type(exc).__name__).splitlines()[0]
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)[:500]
