"""logit_bias, presence/frequency penalties and bad_words: greedy parity with HF `generate`
(sequence_bias, bad_words_ids, and a processor with vLLM's penalty semantics)."""

import pytest
import torch
from helpers import hf_greedy, mixed_prompts
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LogitsProcessor, LogitsProcessorList

from encdec_engine import SamplingParams
from encdec_engine.layers.sampling_state import BadWords


class VllmPenalties(LogitsProcessor):
    """Reference: logit -= frequency * count + presence * (count > 0), over generated tokens only."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        for row, ids in enumerate(input_ids[:, self.prompt_len :]):
            counts = torch.bincount(ids, minlength=scores.shape[1]).to(scores.dtype)
            scores[row] -= self.frequency * counts + self.presence * (counts > 0).to(scores.dtype)
        return scores


def generate(llm, prompts, **params):
    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, **params), use_tqdm=False)


@pytest.mark.parametrize("presence,frequency", [(1.5, 0.0), (0.0, 0.7), (0.5, 1.0), (-0.5, 0.0)])
def test_presence_and_frequency_penalties_match_reference(bart_llm, hf_bart, presence, frequency):
    prompts = mixed_prompts(bart_llm.get_tokenizer(), n=8, seed=3)
    plain = generate(bart_llm, prompts)
    outs = generate(bart_llm, prompts, presence_penalty=presence, frequency_penalty=frequency)
    assert any(o.outputs[0].token_ids != p.outputs[0].token_ids for o, p in zip(outs, plain))  # it bites
    for o in outs:
        reference = LogitsProcessorList([VllmPenalties(len(o.prompt_token_ids), presence, frequency)])
        ref = hf_greedy(hf_bart, o.encoder_prompt_token_ids, o.prompt_token_ids, 16, logits_processor=reference)
        assert o.outputs[0].token_ids == ref


def test_logit_bias_matches_hf_sequence_bias(bart_llm, hf_bart):
    prompts = mixed_prompts(bart_llm.get_tokenizer(), n=8, seed=4)
    plain = generate(bart_llm, prompts)
    common = plain[0].outputs[0].token_ids[2]
    bias = {common: -4.0, 17: 3.0, 300: 2.5}
    outs = generate(bart_llm, prompts, logit_bias=bias, repetition_penalty=1.3)  # HF: bias first, then the penalty
    assert any(o.outputs[0].token_ids != p.outputs[0].token_ids for o, p in zip(outs, plain))
    for o in outs:
        ref = hf_greedy(hf_bart, o.encoder_prompt_token_ids, o.prompt_token_ids, 16, repetition_penalty=1.3,
                        sequence_bias={(t,): b for t, b in bias.items()})
        assert o.outputs[0].token_ids == ref


def test_bad_words_match_hf_bad_words_ids(bart_llm, hf_bart):
    tok = bart_llm.get_tokenizer()
    prompts = mixed_prompts(tok, n=8, seed=5)
    plain = generate(bart_llm, prompts)
    first = plain[0].outputs[0].token_ids
    # A one-token word the first output uses, and two-token words from it (random weights: odd strings).
    single = next(w for t in first if len(tok.encode(w := tok.decode([t]).strip(), add_special_tokens=False)) == 1)
    pairs = [w for a, b in zip(first, first[1:])
             if len(tok.encode(w := tok.decode([a, b]).strip(), add_special_tokens=False)) == 2][:2]
    params = SamplingParams(temperature=0, max_tokens=16, bad_words=[single, *pairs])
    outs = bart_llm.generate(prompts, params, use_tqdm=False)
    ids = params.resolve_bad_words(tok, bart_llm.engine.input_processor.vocab_size).bad_words_token_ids
    assert params.bad_words_token_ids == []  # the caller's object is left as it was
    assert pairs and any(len(w) == 2 for w in ids)
    assert outs[0].outputs[0].token_ids != first
    for o in outs:
        got = o.outputs[0].token_ids
        assert got == hf_greedy(hf_bart, o.encoder_prompt_token_ids, o.prompt_token_ids, 16, bad_words_ids=ids)
        assert not any(got[i : i + len(w)] == w for w in ids for i in range(len(got)))


def test_banned_bad_word_tokens():
    words = BadWords.build([[7], [1, 2, 3], [4, 5]])
    assert words.banned([]) == [7]
    assert words.banned([9, 1, 2]) == [7, 3]
    assert words.banned([4]) == [7, 5]
    assert words.banned([2]) == [7]


@settings(max_examples=300, deadline=None)
@given(words=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=4), max_size=8),
       tokens=st.lists(st.integers(0, 5), max_size=10))
def test_indexed_bad_words_equal_hf_rule(words, tokens):
    """The index (checked per step) bans exactly what HF's NoBadWordsLogitsProcessor rule bans."""
    hf = [w[-1] for w in words if len(w) == 1 or (len(w) - 1 <= len(tokens) and tokens[len(tokens) - len(w) + 1 :] == w[:-1])]
    assert sorted(BadWords.build(words).banned(tokens)) == sorted(hf)


@pytest.mark.parametrize("field,value,match", [
    ("presence_penalty", 2.5, r"in \[-2, 2\]"), ("frequency_penalty", -3.0, r"in \[-2, 2\]"),
    ("logit_bias", {-1: 1.0}, "non-negative token ids"), ("logit_bias", {5: float("inf")}, "finite"),
    ("bad_words", "word", "list of non-blank strings"), ("bad_words", [" "], "non-blank"),
])
def test_bad_values_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} .*{match}"):
        SamplingParams(**{field: value})


def test_logit_bias_outside_the_vocabulary_is_refused_at_add_time(bart_llm):
    with pytest.raises(ValueError, match="SamplingParams.logit_bias .*vocabulary"):
        generate(bart_llm, ["The rain in spain"], logit_bias={10_000: 1.0})
    assert not bart_llm.engine.has_unfinished_requests()


def test_bad_words_need_a_tokenizer(bart_path, make_llm):
    llm = make_llm(bart_path, num_kv_blocks=100, skip_tokenizer_init=True)
    prompt = {"encoder_prompt": {"prompt_token_ids": [0, 100, 200, 2]}, "decoder_prompt": {"prompt_token_ids": [2]}}
    with pytest.raises(ValueError, match="bad_words needs a tokenizer"):
        generate(llm, [prompt], bad_words=["rain"])
    assert not llm.engine.has_unfinished_requests()


def test_bad_words_follow_the_tokenizer_and_vocabulary():
    """Resolved per engine, on a copy; a word with a token outside the model's vocabulary cannot be generated."""

    class Tokenizer:
        def encode(self, text, add_special_tokens=False):
            return {"river": [5, 6], " river": [7, 8], "huge": [900], " huge": [901]}[text]

    params = SamplingParams(bad_words=["river", " huge"])
    resolved = params.resolve_bad_words(Tokenizer(), vocab_size=901)
    assert resolved.bad_words_token_ids == [[5, 6], [7, 8], [900]] and params.bad_words_token_ids == []

