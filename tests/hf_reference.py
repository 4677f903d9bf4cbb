"""The reference for penalized greedy decoding: transformers' own `generate`.

transformers has the repetition penalty (RepetitionPenaltyLogitsProcessor, over the prompt and
the output) but not OpenAI's presence and frequency penalties; `OutputPenalties` adds those the
way vLLM defines them (output tokens only), after the repetition penalty as vLLM orders them.
Both act on float32 scores with float32 factors, so chunkserve's float32 mode must match bit for
bit. The values the tests use (1.25, 0.5, 0.25) are exact in float32: the proto carries floats.
"""

from __future__ import annotations

PENALTIES = {"repetition_penalty": 1.25, "frequency_penalty": 0.5, "presence_penalty": 0.25}


def hf_greedy(
    model, prompt: list[int], n: int, bad_words: tuple[tuple[int, ...], ...] = (), **penalties: float
) -> list[int]:
    """transformers' greedy generate, exactly n new tokens (no stop on EOS), with `penalties`
    (repetition_penalty, frequency_penalty, presence_penalty; any subset) and vLLM's
    `bad_words` as token sequences (OutputBadWords: transformers' own bad_words_ids also looks
    at the prompt, vLLM only at the output)."""
    import copy

    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class OutputPenalties(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            out = input_ids[:, len(prompt) :]
            counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
            freq = torch.tensor(penalties.get("frequency_penalty", 0.0), dtype=scores.dtype)
            presence = torch.tensor(penalties.get("presence_penalty", 0.0), dtype=scores.dtype)
            return scores - freq * counts - presence * (counts > 0).to(scores.dtype)

    class OutputBadWords(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            out = input_ids[0, len(prompt) :].tolist()
            for word in bad_words:
                if len(out) >= len(word) - 1 and out[len(out) - len(word) + 1 :] == list(word[:-1]):
                    scores[:, word[-1]] = float("-inf")
            return scores

    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = None
    config.do_sample = False
    config.repetition_penalty = penalties.get("repetition_penalty", 1.0)
    config.max_new_tokens = config.min_new_tokens = n
    config.pad_token_id = 0
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            generation_config=config,
            logits_processor=LogitsProcessorList([OutputBadWords(), OutputPenalties()]),
        )
    return out[0, len(prompt) :].tolist()
