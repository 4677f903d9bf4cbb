"""vLLM's bad_words in the scheduler: how a word becomes token sequences (as written and, where
a tokenizer folds the space into the word, with a leading space), and that a request with them
sends the executor its tokens, as a penalized one does (the FakeExecutor checks the history)."""

from __future__ import annotations

import pytest

from scheduler_svc.errors import InvalidRequestError
from scheduler_svc.plan import new_seq
from scheduler_svc.request import Request, SamplingParams
from scheduler_svc.tokenizer import Tokenizer
from scheduler_svc.validation import bad_words_token_ids


class WordTokenizer:
    """A tokenizer that folds a leading space into a word's token (" cat" is not "cat"), as
    BPE tokenizers do, and splits "hotdog" into two tokens either way."""

    VOCAB = {"cat": 1, " cat": 2, "hot": 3, "dog": 4, " hot": 5, " a b": 7}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens, "bad words are tokenized without special tokens"
        if text in self.VOCAB:
            return [self.VOCAB[text]]
        if text.strip() == "hotdog":
            return [self.VOCAB[text[:-3]], self.VOCAB["dog"]]
        if text == "a b":
            return [8, 9, 10]
        raise KeyError(text)


def test_words_with_and_without_the_folded_space():
    tok = WordTokenizer()
    assert bad_words_token_ids(["cat"], tok, 100) == ((1,), (2,))
    assert bad_words_token_ids(["  cat"], tok, 100) == ((1,), (2,))  # leading spaces dropped first
    assert bad_words_token_ids(["hotdog", "hotdog"], tok, 100) == ((3, 4), (5, 4))  # distinct, in order
    # With the space the word takes another number of tokens: only the word as written.
    assert bad_words_token_ids(["a b"], tok, 100) == ((8, 9, 10),)


def test_byte_tokenizer_words_are_their_bytes(byte_tokenizer_dir):
    """One token per byte: " ab" is one token longer than "ab", so only "ab" is banned."""
    tok = Tokenizer(byte_tokenizer_dir)
    assert bad_words_token_ids([" ab", "é"], tok, 257) == ((97, 98), (195, 169))


@pytest.mark.parametrize(
    ("words", "vocab", "message"),
    [
        (["cat", ""], 100, "empty or blank"),
        ([" \t"], 100, "empty or blank"),
        (["x" * 101], 100, "at most 100 characters"),
        ([f"w{i}" for i in range(65)], 100, "at most 64"),
        (["cat"], 2, "outside the vocabulary"),
    ],
)
def test_refused_words(words, vocab, message):
    with pytest.raises(InvalidRequestError, match=message):
        bad_words_token_ids(words, WordTokenizer(), vocab)


def test_a_request_with_bad_words_sends_its_tokens():
    request = Request("r", 7, [1, 2, 3], SamplingParams(bad_words=((4, 5),)), output_token_ids=[9])
    assert request.sampling.needs_tokens and not request.sampling.penalized
    new = new_seq(request)
    assert (new.prompt_token_ids, new.output_token_ids) == ([1, 2, 3], [9])
    plain = new_seq(Request("p", 8, [1], SamplingParams()))
    assert (plain.prompt_token_ids, plain.output_token_ids) == ([], [])
