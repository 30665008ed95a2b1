"""The engine's view of structured output: check a request's constraint, give each sequence its matcher.

The compiled-grammar cache (and xgrammar's view of the vocabulary, half a second to build for a
50k vocabulary) is made on the first constrained request, and xgrammar itself (seconds to import:
it brings transformers) imported then, so an engine that never sees one pays nothing. `check`
runs where the engine validates requests (the server's worker thread), so a schema is compiled
there, not on the engine loop; `matcher` then finds it in the cache.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from kaon_runtime.loader.tokenizer import Tokenizer
from kaon_runtime.sampling import SamplingParams
from kaon_runtime.structured.spec import spec_for

if TYPE_CHECKING:
    from kaon_runtime.structured.compiler import GrammarCache
    from kaon_runtime.structured.matcher import SequenceGrammar


class Grammars:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._cache: GrammarCache | None = None
        self._lock = threading.Lock()

    @property
    def cache(self) -> GrammarCache:
        with self._lock:
            if self._cache is None:
                from kaon_runtime.structured.compiler import GrammarCache
                self._cache = GrammarCache(self.tokenizer, self.vocab_size)
            return self._cache

    def check(self, params: SamplingParams, timeout_s: float | None = None) -> None:
        """Compile the request's constraint, if any; raises InvalidRequestError naming what is wrong (or, with
        `timeout_s`, that it did not compile in time: its compile process is killed then)."""
        spec = spec_for(params)
        if spec is not None:
            self.cache.compile(spec, timeout_s)

    def matcher(self, params: SamplingParams) -> SequenceGrammar | None:
        """A new sequence's grammar state (None: unconstrained)."""
        spec = spec_for(params)
        if spec is None:
            return None
        from kaon_runtime.structured.matcher import SequenceGrammar
        return SequenceGrammar(self.cache.compile(spec))
