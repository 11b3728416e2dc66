"""Whisper timestamp rules vs HF's own `WhisperTimeStampLogitsProcessor`, on random cases."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import WhisperTimeStampLogitsProcessor

from encdec_engine.speech.timestamp_rules import TimestampRules, timestamp_rules_from_generation_config

# Small fake Whisper vocab: text 0..39, eos 40, <|notimestamps|> 41, timestamps 42..59.
EOS, NO_TS, TS_BEGIN, VOCAB = 40, 41, 42, 60
NEG_INF = float("-inf")


def gen_config(max_initial: int | None) -> GenerationConfig:
    kwargs = {} if max_initial is None else {"max_initial_timestamp_index": max_initial}
    return GenerationConfig(no_timestamps_token_id=NO_TS, eos_token_id=EOS, **kwargs)


def text(rng: random.Random) -> int:
    return rng.randrange(EOS)


def stamp(rng: random.Random, lo: int = TS_BEGIN) -> int:
    return rng.randrange(lo, VOCAB)


def random_generated(rng: random.Random, length: int | None = None) -> list[int]:
    """Generated tokens of one of the shapes the rules branch on."""
    kind = rng.choice(["empty", "text", "one_ts", "two_ts", "decreasing", "mixed", "lone_ts"])
    n = rng.randrange(1, 8) if length is None else length
    if kind == "empty" and length is None:
        return []
    if kind == "lone_ts" and length is None:
        return [stamp(rng)]
    if kind == "text":
        return [text(rng) for _ in range(n)]
    seq = [rng.choice([text(rng), stamp(rng)]) for _ in range(n)]
    if kind == "one_ts" and n >= 2:  # text, then an opening timestamp
        seq[-2:] = [text(rng), stamp(rng)]
    elif kind == "two_ts" and n >= 2:  # a closing pair (not necessarily ordered)
        seq[-2:] = [stamp(rng), stamp(rng)]
    elif kind == "decreasing" and n >= 2:
        hi = stamp(rng, TS_BEGIN + 1)
        seq[-2:] = [hi, rng.randrange(TS_BEGIN, hi)]
    return seq


def random_logits(rng: random.Random, gen: torch.Generator, rows: int, width: int) -> torch.Tensor:
    logits = torch.randn(rows, width, generator=gen) * rng.choice([0.5, 1.0, 3.0])
    # Shift the timestamp block so their summed mass sometimes dominates, sometimes not.
    logits[:, TS_BEGIN:] += rng.choice([-6.0, -3.0, 0.0, 2.0, 5.0])
    if rng.random() < 0.3:  # some already-suppressed entries, as from suppress_tokens
        logits[:, rng.sample(range(width), 3)] = NEG_INF
    return logits


def compare(rules: TimestampRules, hf: WhisperTimeStampLogitsProcessor, prompt: list[list[int]],
            generated: list[list[int]], logits: torch.Tensor) -> torch.Tensor:
    input_ids = torch.tensor([p + g for p, g in zip(prompt, generated)], dtype=torch.long)
    expected = hf(input_ids, logits.clone())
    ours = logits.clone()
    for i, out in enumerate(generated):
        rules(list(out), ours[i])  # a view: must edit in place
    torch.testing.assert_close(ours, expected, rtol=0, atol=0, equal_nan=True)
    return ours


def processors(max_initial: int | None, begin_index: int, detect: bool = True):
    gc = gen_config(max_initial)
    rules = timestamp_rules_from_generation_config(gc)
    if not detect:
        rules = TimestampRules(TS_BEGIN, NO_TS, EOS, max_initial, detect_from_logprob=False)
    hf = WhisperTimeStampLogitsProcessor(gc, begin_index=begin_index, _detect_timestamp_from_logprob=detect)
    return rules, hf


@pytest.mark.parametrize("width", [VOCAB, VOCAB + 4])  # + 4: padded lm head beyond the tokenizer
def test_single_rows_match_hf(width):
    rng, gen = random.Random(width), torch.Generator().manual_seed(width)
    text_banned = not_banned = 0
    for _ in range(300):
        prompt = [rng.randrange(TS_BEGIN if rng.random() < 0.8 else VOCAB) for _ in range(rng.randrange(1, 5))]
        generated = random_generated(rng)
        rules, hf = processors(rng.choice([None, 0, 1, 3, 10, 50]), len(prompt), detect=rng.random() < 0.85)
        out = compare(rules, hf, [prompt], [generated], random_logits(rng, gen, 1, width))
        if torch.isinf(out[0, :TS_BEGIN]).all():
            text_banned += 1
        else:
            not_banned += 1
    assert text_banned > 30 and not_banned > 30  # both outcomes of the logprob rule were exercised


def test_rows_outside_the_numpy_path_match_hf():
    """Rows that are not float32 on the CPU (half precision, CUDA) are edited through torch, not numpy."""
    rng, gen = random.Random(7), torch.Generator().manual_seed(7)
    for _ in range(100):
        prompt = [rng.randrange(TS_BEGIN) for _ in range(rng.randrange(1, 5))]
        rules, hf = processors(rng.choice([None, 1, 50]), len(prompt))
        compare(rules, hf, [prompt], [random_generated(rng)], random_logits(rng, gen, 1, VOCAB).double())


def test_batches_match_hf():
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    for _ in range(60):
        rows, prompt_len, gen_len = rng.randrange(2, 6), rng.randrange(1, 5), rng.randrange(0, 6)
        prompts = [[rng.randrange(TS_BEGIN) for _ in range(prompt_len)] for _ in range(rows)]
        generated = [random_generated(rng, gen_len) if gen_len else [] for _ in range(rows)]
        rules, hf = processors(rng.choice([None, 2, 50]), prompt_len)
        compare(rules, hf, prompts, generated, random_logits(rng, gen, rows, rng.choice([VOCAB, VOCAB + 4])))


def test_no_max_initial_timestamp():
    rules, hf = processors(None, begin_index=2)
    assert rules.max_initial_timestamp_index is None and hf.max_initial_timestamp_index is None
    logits = torch.zeros(1, VOCAB)
    logits[0, -1] = 10.0  # the latest timestamp stays allowed at the first position
    out = compare(rules, hf, [[1, 2]], [[]], logits)
    assert torch.isinf(out[0, :TS_BEGIN]).all() and torch.isfinite(out[0, TS_BEGIN:]).all()


def test_rules_edge_cases():
    rules, _ = processors(3, begin_index=1, detect=False)  # the pairing rules alone
    first = torch.zeros(VOCAB)
    rules([], first)  # only <|0.00|>..<|0.06|> at the first position
    assert torch.isfinite(first).nonzero().flatten().tolist() == list(range(TS_BEGIN, TS_BEGIN + 4))
    after_lone = torch.zeros(VOCAB)
    rules([TS_BEGIN], after_lone)  # a first timestamp counts as a closed pair: text next
    assert torch.isinf(after_lone[TS_BEGIN:]).all() and torch.isfinite(after_lone[:EOS]).all()
    opening = torch.zeros(VOCAB)
    rules([TS_BEGIN, 5, TS_BEGIN + 7], opening)  # may repeat <|0.14|> to close, or stop; no text
    assert torch.isinf(opening[:EOS]).all() and opening[EOS] == 0 and opening[TS_BEGIN + 7] == 0
    assert torch.isinf(opening[TS_BEGIN : TS_BEGIN + 7]).all()
    # The logprob rule bans everything below timestamp_begin, eos included: 11 equal
    # timestamps outweigh eos alone.
    detecting = TimestampRules(TS_BEGIN, NO_TS, EOS, 3)
    opening = torch.zeros(VOCAB)
    detecting([TS_BEGIN, 5, TS_BEGIN + 7], opening)
    assert torch.isinf(opening[:TS_BEGIN]).all()


def test_from_whisper_generation_config():
    gc = GenerationConfig(no_timestamps_token_id=50363, eos_token_id=50257, bos_token_id=50257,
                          max_initial_timestamp_index=50)
    rules = timestamp_rules_from_generation_config(gc)
    hf = WhisperTimeStampLogitsProcessor(gc, begin_index=3)
    assert rules == TimestampRules(50364, 50363, 50257, 50, True)
    assert (rules.timestamp_begin, rules.eos_token_id) == (hf.timestamp_begin, hf.eos_token_id)
    logits = torch.randn(2, 51865, generator=torch.Generator().manual_seed(0))
    generated = [[50364, 300, 400], [50364, 300, 50400]]
    input_ids = torch.tensor([[50258, 50259, 50359] + g for g in generated])  # sot, lang, task
    expected = hf(input_ids, logits.clone())
    for i, g in enumerate(generated):
        rules(g, logits[i])
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    # Like HF, fall back to bos when eos is unset.
    no_eos = GenerationConfig(no_timestamps_token_id=NO_TS, bos_token_id=EOS)
    assert timestamp_rules_from_generation_config(no_eos).eos_token_id == EOS
