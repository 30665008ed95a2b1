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
