"""Sampling: processors vs HF, seeded reproducibility, truncation, stop conditions, detokenization."""

import pytest
import torch
from helpers import hf_greedy, mixed_prompts
from transformers import BartForConditionalGeneration

from encdec_engine import SamplingParams
from encdec_engine.layers.logits_processors import SamplingRow, apply_top_k_top_p_min_p, banned_ngram_tokens


@pytest.fixture(scope="module")
def llm(bart_path, make_llm):
    return make_llm(bart_path, num_kv_blocks=400)


@pytest.fixture(scope="module")
def hf_model(bart_path):
    return BartForConditionalGeneration.from_pretrained(bart_path).eval()


@pytest.mark.parametrize(
    "ours,theirs",
    [
        (dict(repetition_penalty=1.5), dict(repetition_penalty=1.5)),
        (dict(no_repeat_ngram_size=2), dict(no_repeat_ngram_size=2)),
        (dict(min_tokens=12), dict(min_new_tokens=12)),
        (dict(forced_eos_token_id=2), dict(forced_eos_token_id=2)),
        (dict(repetition_penalty=0.8, no_repeat_ngram_size=3), dict(repetition_penalty=0.8, no_repeat_ngram_size=3)),
    ],
)
def test_processors_match_hf(llm, hf_model, ours, theirs):
    prompts = mixed_prompts(llm.get_tokenizer(), n=12, seed=21)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, **ours), use_tqdm=False)
    for o in outs:
        ref = hf_greedy(hf_model, o.encoder_prompt_token_ids, o.prompt_token_ids, 16, **theirs)
        assert o.outputs[0].token_ids == ref


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    prompts = mixed_prompts(llm.get_tokenizer(), n=6, seed=3)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=12) for i in range(6)]
    a = llm.generate(prompts, params, use_tqdm=False)
    b = llm.generate(prompts, params, use_tqdm=False)
    alone = llm.generate([prompts[2]], [params[2]], use_tqdm=False)[0]
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert alone.outputs[0].token_ids == a[2].outputs[0].token_ids
    other_seed = llm.generate(prompts, [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=12)
                                        for i in range(6)], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in other_seed] != [o.outputs[0].token_ids for o in a]


def test_top_k_1_is_greedy(llm):
    prompts = mixed_prompts(llm.get_tokenizer(), n=5, seed=4)
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    top1 = llm.generate(prompts, SamplingParams(temperature=0.7, top_k=1, seed=1, max_tokens=10), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in top1]


def test_n_samples_per_request(llm):
    out = llm.generate(["The rain in spain"], SamplingParams(n=3, temperature=8.0, seed=5, max_tokens=8),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 3 and [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    best = llm.generate(["The rain in spain"], SamplingParams(n=1, best_of=3, temperature=1.0, seed=5,
                                                                max_tokens=8, logprobs=0), use_tqdm=False)[0]
    assert len(best.outputs) == 1


def truncation_row(**params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), [2], [])


def test_top_k_top_p_min_p_truncation():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4))
    rows = [truncation_row(top_k=2), truncation_row(top_p=0.7), truncation_row(top_p=0.81),
            truncation_row(min_p=0.5)]
    kept = torch.isfinite(apply_top_k_top_p_min_p(logits, rows))
    assert kept.tolist() == [[True, True, False, False], [True, True, False, False],
                             [True, True, True, False], [True, True, False, False]]


def test_banned_ngrams():
    assert banned_ngram_tokens([1, 2, 3, 1, 2], 3) == [3]
    assert banned_ngram_tokens([1, 2, 1], 2) == [2]
    assert banned_ngram_tokens([1], 3) == []


def test_stop_conditions(llm):
    prompt = "The rain in spain falls mainly on the plain."
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    toks = base.outputs[0].token_ids
    assert base.outputs[0].finish_reason == "length" and len(toks) == 20
    stop_tok = toks[5]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok and out.token_ids == toks[: toks.index(stop_tok) + 1]
    text = base.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if stop.strip():
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=stop),
                           use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop and out.text == text[: text.index(stop)]


def test_incremental_text_equals_full_decode_and_logprobs(llm):
    tok = llm.get_tokenizer()
    outs = llm.generate(mixed_prompts(tok, n=8, seed=8), SamplingParams(temperature=0, max_tokens=24, logprobs=3),
                        use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        assert len(c.logprobs) == len(c.token_ids)
        for tid, lp in zip(c.token_ids, c.logprobs):
            assert tid in lp and len(lp) in (3, 4) and lp[tid] == max(lp.values())  # greedy picks the max
        assert c.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(c.token_ids, c.logprobs)))
