"""Tokenizer, chat template and incremental detokenizer (byte-level toy tokenizer)."""

from __future__ import annotations

import pytest

from scheduler_svc.tokenizer import IncrementalDetokenizer, Tokenizer


def stream(tok: Tokenizer, text: str, stop=()) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, tok.encode("prompt"), stop)
    deltas = [detok.add(t) for t in tok.encode(text)]
    deltas.append(detok.flush())
    return deltas, detok


def test_multibyte_characters_are_never_split(byte_tokenizer_dir):
    tok = Tokenizer(byte_tokenizer_dir)
    text = "你好，世界 — ok 🙂!"
    assert len(tok.encode(text)) == len(text.encode())  # one token per byte
    deltas, _ = stream(tok, text)
    assert "".join(deltas) == text
    for d in deltas:
        d.encode("utf-8")  # raises on a lone surrogate / split char
        assert "\ufffd" not in d
    assert sum(1 for d in deltas if d) == len(text)  # each character exactly once


@pytest.mark.parametrize(
    "stop, expected", [("wor", "hello "), ("o", "hell"), ("界", "hello world 世"), ("zzz", "hello world 世界")]
)
def test_stop_strings_cut_the_text_and_never_leak(byte_tokenizer_dir, stop, expected):
    tok = Tokenizer(byte_tokenizer_dir)
    detok = IncrementalDetokenizer(tok, [], (stop, "another"))
    out = ""
    for t in tok.encode("hello world 世界"):
        out += detok.add(t)
        assert stop not in out
        if detok.matched_stop:
            break
    out += detok.flush()
    assert out == expected
    assert detok.matched_stop == (None if stop == "zzz" else stop)


def test_output_cut_inside_a_character_flushes_a_replacement_char(byte_tokenizer_dir):
    tok = Tokenizer(byte_tokenizer_dir)
    detok = IncrementalDetokenizer(tok, [], ())
    ids = tok.encode("ab你")[:-1]  # the last character's final byte never arrives
    streamed = "".join(detok.add(t) for t in ids)
    assert streamed == "ab"
    assert streamed + detok.flush() == tok.decode(ids) == "ab\ufffd"


def test_chat_template_and_eos(byte_tokenizer_dir):
    tok = Tokenizer(byte_tokenizer_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(ids) == "<user>hi<assistant>"
    assert tok.eos_token_id == 256
    assert tok.decode([104, 256, 105]) == "hi"  # special tokens are skipped


def test_no_chat_template_is_a_clear_error(byte_tokenizer_dir):
    (byte_tokenizer_dir / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(byte_tokenizer_dir).apply_chat_template([{"role": "user", "content": "x"}])
