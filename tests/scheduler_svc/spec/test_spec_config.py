"""--speculative-config as vLLM spells it: vLLM's defaults, and a ValueError naming the key for
anything chunkserve would not honour."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler_svc.spec.config import SpeculativeConfig, parse_speculative_config
from scheduler_svc.spec.ngram import NgramProposer
from scheduler_svc.spec.suffix import SuffixProposer


def test_ngram_defaults_follow_vllm():
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 5, 5)
    c = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    p = parse_speculative_config(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    ).make_proposer()
    assert isinstance(p, NgramProposer) and (p.min_n, p.max_n) == (1, 3)


def test_suffix_defaults_follow_vllm():
    c = parse_speculative_config('{"method": "suffix"}')
    assert c.num_speculative_tokens == 24  # the tree depth when left out
    assert (c.suffix_decoding_max_tree_depth, c.suffix_decoding_max_cached_requests) == (24, 10000)
    assert (c.suffix_decoding_max_spec_factor, c.suffix_decoding_min_token_prob) == (1.0, 0.1)
    c = parse_speculative_config(
        {
            "method": "suffix",
            "num_speculative_tokens": 8,
            "suffix_decoding_max_tree_depth": 16,
            "suffix_decoding_max_cached_requests": 0,
            "suffix_decoding_max_spec_factor": 2,
            "suffix_decoding_min_token_prob": 0.25,
            "suffix_decoding_max_cached_tokens": 5000,
        }
    )
    p = c.make_proposer()
    assert isinstance(p, SuffixProposer)
    assert (p.max_depth, p.max_cached_requests, p.max_spec_factor, p.min_token_prob, p.max_cached_tokens) == (
        16,
        0,
        2.0,
        0.25,
        5000,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.method = "ngram"


def test_no_config_is_no_speculation():
    assert parse_speculative_config(None) is None and parse_speculative_config("  ") is None


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ({"num_speculative_tokens": 4}, "method"),
        ({"method": "eagle", "num_speculative_tokens": 4}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 65}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2.0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3}, "<="),
        ({"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 8}, "does not apply"),
        ({"method": "suffix", "prompt_lookup_max": 3}, "does not apply"),
        ({"method": "suffix", "model": "some/draft"}, "'model' is not supported"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 4}, "not supported"),
        ({"method": "suffix", "num_spec_tokens": 4}, "unknown key 'num_spec_tokens'"),
        ({"method": "suffix", "suffix_decoding_max_tree_depth": 1}, "suffix_decoding_max_tree_depth"),
        ({"method": "suffix", "suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests"),
        ({"method": "suffix", "suffix_decoding_max_spec_factor": -0.5}, "suffix_decoding_max_spec_factor"),
        ({"method": "suffix", "suffix_decoding_max_spec_factor": float("nan")}, "suffix_decoding_max_spec_factor"),
        ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob"),
        ({"method": "suffix", "suffix_decoding_min_token_prob": "0.1"}, "suffix_decoding_min_token_prob"),
    ],
)
def test_what_would_not_be_honoured_is_refused_by_name(value, named):
    with pytest.raises(ValueError, match=named):
        parse_speculative_config(value)


def test_the_config_is_a_plain_frozen_value():
    assert SpeculativeConfig("ngram", 2, 1, 2) == parse_speculative_config(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    )
