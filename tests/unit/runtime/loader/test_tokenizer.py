"""Our tokenizer, built from GGUF metadata alone, agrees with HF's on the same file."""
from __future__ import annotations

import pytest

from kaon_runtime.loader.gguf_file import load_gguf
from kaon_runtime.loader.tokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world!", "  leading spaces and trailing  ", "numbers 1234567 and 3.14159", "tabs\tand\nnewlines\n\n",
    "Ünïcödé: naïve café, 東京, Привет, 🤖🚀", "code: def f(x):\n    return x ** 2  # square",
    "<|im_start|>user\nhi<|im_end|>\n", "email@example.com https://kaon.dev/a?b=c", "",
    "don't won't it's we're they'll I'd", "MiXeD CaSe AND ALLCAPS", "a" * 300,
]


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    return load_gguf(gguf_path).tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_hf(tokenizer, hf_tokenizer, text):
    assert tokenizer.encode(text) == hf_tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


def test_chat_template_matches_hf(tokenizer, hf_tokenizer):
    for messages in ([{"role": "user", "content": "Hi there"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]):
        ours = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        theirs = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert ours == theirs


def test_special_tokens(tokenizer):
    assert tokenizer.eos_token_ids == [2]  # <|im_end|> ends an assistant turn
    assert tokenizer.encode("<|im_end|>") == [2]


def test_incremental_detokenizer_never_emits_half_characters(tokenizer):
    text = "Emoji 🤖 then 東京 and café."
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=tokenizer.encode("Prompt:"))
    pieces = [detok.add(t) for t in ids]
    assert "".join(pieces) == text == detok.text
    assert all("\ufffd" not in p for p in pieces)


class _WholeWindowDetokenizer:
    """The detokenizer before tokens that decode drops were left out of its window: the reference."""

    def __init__(self, tokenizer, prompt_ids):
        self.tokenizer, self.ids = tokenizer, list(prompt_ids[-6:])
        self.prefix_offset, self.read_offset, self.text = 0, len(self.ids), ""

    def add(self, token_id):
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        new = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += new
        return new


def _mixed_ids(rng, vocab: int, special: list[int], n: int) -> list[int]:
    """Ids of every kind: ordinary, special (decode skips them), past the vocabulary (decode drops them),
    in runs, and bytes that split UTF-8 characters (the byte tokenizer's 128-255)."""
    out = []
    while len(out) < n:
        kind = rng.random()
        if kind < 0.4:
            out.append(rng.randrange(vocab))
        elif kind < 0.55:
            out.append(rng.choice(special))
        elif kind < 0.8:
            out += [rng.randrange(vocab, vocab + 5000) for _ in range(rng.randint(1, 20))]
        else:
            out.append(rng.randrange(128, 256))
    return out[:n]


def test_detokenizer_leaving_out_dropped_tokens_changes_no_text(tokenizer):
    """Pieces and text are the whole-window algorithm's, token for token, on the bundled tokenizer (special
    tokens) and the byte tokenizer random:// models use (ids past 255 have no token)."""
    import random

    from kaon_runtime.loader.tokenizer import Tokenizer
    rng = random.Random(0)
    byte_level = Tokenizer.bytes_only(bos_token_id=1, eos_token_id=2)
    special = [i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special]
    assert special, "the bundled tokenizer has special tokens to drop"
    streamed = 0
    for tok, vocab, specials in ((tokenizer, tokenizer.vocab_size, special), (byte_level, 256, [0, 1, 2])):
        for trial in range(30):
            prompt = _mixed_ids(rng, vocab, specials, rng.randint(1, 10))
            ours, reference = IncrementalDetokenizer(tok, prompt), _WholeWindowDetokenizer(tok, prompt)
            for token in _mixed_ids(rng, vocab, specials, 200):
                assert ours.add(token) == reference.add(token), (trial, token)
                streamed += ours._stream is not None
            assert ours.text == reference.text
    assert streamed > 0.9 * 2 * 30 * 200, "both tokenizers are ByteLevel: tokenizers' DecodeStream does the work"
    runs = IncrementalDetokenizer(byte_level, [65])
    for token in [300] * 50 + [66]:
        runs.add(token)
    assert runs.text == byte_level.decode([66]) and len(runs.ids) == 2, "a run of dropped ids stays out of the window"


def test_detokenizer_stream_refusing_a_step_hands_back_to_the_window(tokenizer, monkeypatch):
    """Where tokenizers' DecodeStream raises (its InvalidPrefix), the Python window takes that token and every
    later one, with the same pieces as the reference; a tokenizer whose decoder is not ByteLevel never streams."""
    import random

    from tokenizers import decoders
    rng = random.Random(1)
    special = [i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special]
    for refuse_at in (0, 1, 7, 50):
        prompt = _mixed_ids(rng, tokenizer.vocab_size, special, 6)
        ours, reference = IncrementalDetokenizer(tokenizer, prompt), _WholeWindowDetokenizer(tokenizer, prompt)
        for n, token in enumerate(_mixed_ids(rng, tokenizer.vocab_size, special, 120)):
            if n == refuse_at and ours._stream is not None:
                monkeypatch.setattr(ours, "_stream", _Refusing())
            assert ours.add(token) == reference.add(token), (refuse_at, n)
        assert ours.text == reference.text and ours._stream is None
    plain = _PlainDecoder(tokenizer, decoders.Metaspace())
    assert IncrementalDetokenizer(plain, [1, 2, 3])._stream is None


class _Refusing:
    def step(self, tokenizer, token_id):
        raise Exception("InvalidPrefix")


class _PlainDecoder:
    def __init__(self, tokenizer, decoder):
        from tokenizers import Tokenizer as HFTokenizer
        self.backend = HFTokenizer.from_str(tokenizer.backend.to_str())
        self.backend.decoder = decoder
        self.decode = lambda ids: self.backend.decode(ids, skip_special_tokens=True)
