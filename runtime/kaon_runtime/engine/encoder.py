"""The encoder engine: a sentence encoder's forward over a batch of inputs, pooled as its config says.

No scheduler, no KV cache: an encoder's input is one bidirectional forward and nothing is
generated, so a request's inputs run together, padded, sorted by length in batches of
`max_batch` (less padding), and requests take turns through one lock (torch uses every core).
Pooling and normalization follow the checkpoint's sentence-transformers config (modules.json:
Pooling mean or CLS, Normalize), and inputs are cut at its max_seq_length as
sentence-transformers cuts them (embed's default, truncate=-1), so the vectors are the ones it computes
on the same weights. The HTTP API refuses a longer input unless the request asks for the cut
(truncate=None; engine/embed_input.py).
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from kaon_runtime.engine.embed_input import check_length, kept_tokens
from kaon_runtime.errors import InvalidRequestError
from kaon_runtime.models.bert import BertEncoder, cls_pool, load_bert, mean_pool


@dataclass(frozen=True)
class SentenceConfig:
    """What a checkpoint's sentence-transformers files say about turning hidden states into a vector."""
    pooling: str  # "mean" or "cls"
    normalize: bool
    max_seq_length: int


def sentence_config(root: Path, max_positions: int) -> SentenceConfig:
    """modules.json's Pooling (mean, or CLS) and Normalize, and sentence_bert_config.json's max_seq_length
    (the model's position count when absent). No modules.json: mean, not normalized (its own default)."""
    pooling, normalize = "mean", False
    modules_file = root / "modules.json"
    if modules_file.is_file():
        modules = json.loads(modules_file.read_text())
        normalize = any(m.get("type", "").endswith("Normalize") for m in modules)
        for m in modules:
            if m.get("type", "").endswith("Pooling"):
                config = json.loads((root / m["path"] / "config.json").read_text())
                if config.get("pooling_mode_cls_token"):
                    pooling = "cls"
                elif not config.get("pooling_mode_mean_tokens"):
                    raise ValueError(f"{root}: only mean or CLS pooling is supported: {config}")
    limit = max_positions
    bert_file = root / "sentence_bert_config.json"
    if bert_file.is_file():
        limit = min(limit, int(json.loads(bert_file.read_text()).get("max_seq_length") or limit))
    return SentenceConfig(pooling, normalize, limit)


class EncoderEngine:
    def __init__(self, root: Path, max_batch: int = 32, dtype: torch.dtype = torch.float32):
        self.model: BertEncoder = load_bert(root, dtype)
        self.sentence = sentence_config(root, self.model.config.max_position_embeddings)
        self.tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()  # the whole input is counted; token_ids cuts it when asked
        post = self.tokenizer.post_processor
        self.num_special = post.num_special_tokens_to_add(False) if post is not None else 0
        self.pad_id = self.tokenizer.token_to_id("[PAD]") or 0
        self.hidden_size = self.model.config.hidden_size
        self.max_batch = max_batch
        self._lock = threading.Lock()

    def token_ids(self, prompt: str | list[int], truncate: int | None = -1) -> list[int]:
        """A string with the tokenizer's [CLS] ... [SEP]; token ids as sent. `truncate`: vLLM's truncate_prompt_tokens
        (-1: cut at max_seq_length, as sentence-transformers; k: the first k tokens, the special ones among them, as
        transformers' truncation; None: an input past max_seq_length is refused)."""
        limit = self.sentence.max_seq_length
        keep = kept_tokens(truncate, limit)
        if isinstance(prompt, str):
            encoding = self.tokenizer.encode(prompt, add_special_tokens=False)
            if keep is not None and len(encoding.ids) + self.num_special > keep:
                if keep <= self.num_special:
                    raise InvalidRequestError(f"truncate_prompt_tokens ({keep}) leaves no room for the input: this "
                                              f"model adds {self.num_special} special tokens to every input")
                encoding.truncate(keep - self.num_special)
            ids = self.tokenizer.post_process(encoding).ids
        else:
            if any(not 0 <= i < self.model.config.vocab_size for i in prompt):
                raise InvalidRequestError(f"token ids must lie in [0, {self.model.config.vocab_size})")
            ids = prompt if keep is None else prompt[:keep]
        check_length(len(ids), limit)
        return ids

    def embed(self, prompts: list[str | list[int]], normalize: bool | None = None,
              truncate: int | None = -1) -> list[tuple[list[float], int]]:
        """Per input: its pooled vector, L2-normalized when `normalize` (None: as the checkpoint's config says),
        and its token count. `truncate` as token_ids takes it: every input is checked before any runs."""
        normalize = self.sentence.normalize if normalize is None else normalize
        ids = [self.token_ids(p, truncate) for p in prompts]
        vectors: list[list[float] | None] = [None] * len(ids)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        with self._lock, torch.inference_mode():
            for start in range(0, len(order), self.max_batch):
                batch = order[start:start + self.max_batch]
                for i, vector in zip(batch, self._forward([ids[i] for i in batch], normalize)):
                    vectors[i] = vector
        return [(v, len(t)) for v, t in zip(vectors, ids) if v is not None]

    def _forward(self, batch: list[list[int]], normalize: bool) -> list[list[float]]:
        width = max(len(t) for t in batch)
        input_ids = torch.tensor([t + [self.pad_id] * (width - len(t)) for t in batch])
        mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in batch])
        hidden = self.model(input_ids, mask)
        pooled = mean_pool(hidden, mask) if self.sentence.pooling == "mean" else cls_pool(hidden)
        if normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled.tolist()
