"""Sampling: processors vs HF, seeded reproducibility, truncation, stop conditions, detokenization."""

import pytest
import torch
from helpers import hf_greedy, mixed_prompts

from encdec_engine import SamplingParams
from encdec_engine.layers.logits_processors import SamplingRow, apply_top_k_top_p_min_p, banned_ngram_tokens


@pytest.fixture
def llm(bart_llm):
    return bart_llm


@pytest.fixture
def hf_model(hf_bart):
    return hf_bart


@pytest.mark.parametrize(
    "ours,theirs",
    [
        (dict(repetition_penalty=1.5), dict(repetition_penalty=1.5)),
        (dict(no_repeat_ngram_size=2), dict(no_repeat_ngram_size=2)),
        (dict(min_tokens=12), dict(min_new_tokens=12)),
        (dict(forced_eos_token_id=2), dict(forced_eos_token_id=2)),
        (dict(repetition_penalty=0.8, no_repeat_ngram_size=3), dict(repetition_penalty=0.8, no_repeat_ngram_size=3)),
        # HF forces BOS only after a one-token decoder prompt: never here ([2, 0] and longer prompts).
        (dict(forced_bos_token_id=0), dict(forced_bos_token_id=0)),
    ],
)
def test_processors_match_hf(llm, hf_model, ours, theirs):
    prompts = mixed_prompts(llm.get_tokenizer(), n=12, seed=21)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, **ours), use_tqdm=False)
    for o in outs:
        ref = hf_greedy(hf_model, o.encoder_prompt_token_ids, o.prompt_token_ids, 16, **theirs)
        assert o.outputs[0].token_ids == ref


def test_forced_bos_after_a_start_token_prompt_pushes_begin_suppression_on(llm, hf_model):
    """HF: with a one-token decoder prompt and forced_bos, begin_suppress_tokens act on the token after BOS."""
    prompt = {"encoder_prompt": "The rain in spain falls mainly", "decoder_prompt": {"prompt_token_ids": [2]}}
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, forced_bos_token_id=0),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert plain[0] == 0
    params = dict(forced_bos_token_id=0, begin_suppress_tokens=[plain[1]])
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, **params), use_tqdm=False)[0]
    assert out.outputs[0].token_ids[1] != plain[1]
    assert out.outputs[0].token_ids == hf_greedy(hf_model, out.encoder_prompt_token_ids, [2], 6, **params)


def test_forced_eos_fills_the_model_length_limit(bart_path, make_llm, hf_model):
    """max_tokens=None runs to the length limit, where forced_eos_token_id is forced as in HF."""
    llm = make_llm(bart_path, num_kv_blocks=400, max_model_len=12)
    out = llm.generate(["The rain in spain falls mainly"], SamplingParams(temperature=0, max_tokens=None,
                                                                          forced_eos_token_id=2), use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(out.prompt_token_ids) + len(c.token_ids) == 12 and c.token_ids[-1] == 2
    assert c.token_ids == hf_greedy(hf_model, out.encoder_prompt_token_ids, out.prompt_token_ids, 10,
                                    forced_eos_token_id=2)


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
    tok = llm.get_tokenizer()
    assert out.text == tok.decode(out.token_ids[:-1])  # vLLM: the stop token's text is left out
    kept = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_tok],
                                                 include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == tok.decode(out.token_ids).rstrip("\ufffd")  # an incomplete character waits, as in vLLM
    eos = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok],
                                                skip_special_tokens=False), use_tqdm=False)[0].outputs[0]
    assert not eos.text.endswith("</s>") and eos.stop_reason in (None, stop_tok)
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


def test_final_text_keeps_a_character_cut_off_by_the_token_limit(llm):
    """Tokens that end inside a multi-byte character: the incremental text holds them back while more could
    complete it, and the finished text is transformers' decode, U+FFFD included (it was dropped)."""
    tok = llm.get_tokenizer()
    partial = next(i for i in range(len(tok)) if tok.decode([i]) == "\ufffd")  # one byte of a longer character
    out = llm.generate(["x"], SamplingParams(temperature=0, max_tokens=2, allowed_token_ids=[partial]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and out.token_ids == [partial, partial]
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True) and out.text.endswith("\ufffd")


@pytest.mark.parametrize("field,value,match", [
    ("n", 2.0, "must be an integer"), ("max_tokens", 2.5, "must be an integer"), ("top_k", 2.5, "must be an integer"),
    ("temperature", float("nan"), "finite"), ("repetition_penalty", float("inf"), "finite"),
    ("allowed_token_ids", [], "must not be empty"), ("suppress_tokens", [-1], "non-negative token ids"),
])
def test_bad_sampling_params_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} .*{match}"):
        SamplingParams(**{field: value})


def test_beam_search_refuses_stop_strings_and_logprobs():
    for bad in (dict(stop="x"), dict(logprobs=2)):
        with pytest.raises(ValueError, match="num_beams"):
            SamplingParams(num_beams=2, temperature=0.0, **bad)


@pytest.mark.parametrize("bad", [dict(allowed_token_ids=[1, 10_000]),
                                 dict(suppress_tokens=[10_000]), dict(begin_suppress_tokens=[10_000]),
                                 dict(forced_bos_token_id=10_000), dict(forced_eos_token_id=10_000)])
def test_token_ids_outside_the_vocabulary_are_refused_at_add_time(llm, bad):
    """A clear ValueError before anything runs; the other prompts of the engine are untouched."""
    field = next(iter(bad))
    with pytest.raises(ValueError, match=f"SamplingParams.{field} .*vocabulary"):
        llm.generate(["The rain in spain"], SamplingParams(temperature=0, max_tokens=4, **bad), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_argmax_rows_is_torch_argmax():
    """The CPU argmax (numpy's) gives torch's answer: the first maximum, NaN counting as the largest."""
    from encdec_engine.layers.sampler import argmax_rows

    x = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0))
    x[1] = float("-inf")
    x[2, [5, 700]] = float("nan")
    x[3, [10, 20]] = 99.0
    x[4] = 1.0
    x[5, 3], x[5, 9] = float("inf"), float("nan")
    assert argmax_rows(x).tolist() == x.argmax(dim=-1).tolist() == [int(x[0].argmax()), 0, 5, 10, 0, 9]
    assert argmax_rows(x.double()).tolist() == x.argmax(dim=-1).tolist()  # not float32: torch's own


def test_only_rows_that_read_log_probabilities_get_them():
    """The log-softmax over the vocabulary is computed for the rows whose request reads it (logprobs, best_of
    ranking), with the values of the whole batch's; the others get their token and no log-probability."""
    from encdec_engine.layers.sampler import Sampler
    from encdec_engine.layers.sampling_state import RequestSampling

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0),
              SamplingParams(temperature=0, n=1, best_of=2)]
    rows = [SamplingRow(p, [2], [], RequestSampling.build(p, [], 50, torch.device("cpu"))) for p in params]
    results = Sampler()(logits.clone(), rows)
    full = logits.log_softmax(dim=-1)
    assert [r.token_id for r in results] == logits.argmax(dim=-1).tolist()
    assert [r.logprob is None for r in results] == [True, False, True, False]
    for i in (1, 3):
        assert results[i].logprob == full[i, results[i].token_id].item()
    values, ids = full[1].topk(2)
    top = {results[1].token_id: full[1].max().item(), **dict(zip(ids.tolist(), values.tolist()))}
    assert results[1].top_logprobs == top
    assert all(r.logprob is not None for r in Sampler()(logits.clone(), [rows[1], rows[3]]))  # every row scored
    assert [r.logprob for r in Sampler()(logits.clone(), [rows[0], rows[2]])] == [None, None]
