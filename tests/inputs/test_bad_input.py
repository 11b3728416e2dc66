"""Bad input gets a clear ValueError naming the problem and never hurts other requests."""

import pytest

from encdec_engine import SamplingParams
from encdec_engine.inputs.preprocess import InputProcessor
from encdec_engine.sampling_params import (MAX_BAD_WORD_CHARS, MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_SEED,
                                           MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
                                           MAX_TOKEN_ID_LIST)

GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def llm(bart_path, make_llm):
    return make_llm(bart_path, num_kv_blocks=300)


@pytest.mark.parametrize(
    "prompt,match",
    [
        ("", "encoder prompt is empty"),
        ({"prompt_token_ids": []}, "encoder prompt is empty"),
        ({"prompt_token_ids": [0, 5, 99999, 2]}, "token id 99999 at index 2 is outside the vocabulary"),
        ({"prompt_token_ids": [0, -1]}, "token id -1 at index 1"),
        ({"prompt_token_ids": [0] * 300}, "300 tokens, more than the model's limit of 256.*truncate_prompt_tokens"),
        ({"encoder_prompt": "hi", "decoder_prompt": {"prompt_token_ids": [2] * 256}}, "decoder_prompt has 256 tokens"),
        ({"encoder_prompt": "hi", "decoder_prompt": ""}, "decoder_prompt is empty"),
        ({"encoder_prompt": "hi", "decoder": "x"}, "unknown keys"),
        ({"text": "hi"}, "needs 'prompt' or 'prompt_token_ids'"),
        ({"prompt_token_ids": "abc"}, "must be a list of ints"),
        (42, "unsupported prompt type int"),
    ],
)
def test_bad_prompts(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], GREEDY, use_tqdm=False)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    out = llm.generate([{"prompt_token_ids": list(range(5, 305))}],
                       SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=100), use_tqdm=False)[0]
    assert out.encoder_prompt_token_ids == list(range(205, 305))


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=-5), "top_k"),
        (dict(min_p=1.5), "min_p"), (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n"),
        (dict(min_tokens=9, max_tokens=3), "min_tokens"), (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(logprobs=-1), "logprobs"), (dict(n=3, best_of=2), "best_of"), (dict(seed=-3), "seed"),
        (dict(early_stopping="sometimes"), "early_stopping"), (dict(length_penalty=400.0), "length_penalty"),
    ],
)
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


CAPS = [("stop", ["s"] * MAX_STOP_STRINGS, str(MAX_STOP_STRINGS)),
        ("stop", ["x" * MAX_STOP_STRING_CHARS], str(MAX_STOP_STRING_CHARS)),
        ("stop_token_ids", [5] * MAX_STOP_TOKEN_IDS, str(MAX_STOP_TOKEN_IDS)),
        ("bad_words", ["w"] * MAX_BAD_WORDS, str(MAX_BAD_WORDS)),
        ("bad_words", ["w" * MAX_BAD_WORD_CHARS], str(MAX_BAD_WORD_CHARS)),
        ("logit_bias", dict.fromkeys(range(MAX_LOGIT_BIAS), 1.0), str(MAX_LOGIT_BIAS)),
        ("suppress_tokens", [1] * MAX_TOKEN_ID_LIST, str(MAX_TOKEN_ID_LIST)),
        ("allowed_token_ids", [1] * MAX_TOKEN_ID_LIST, str(MAX_TOKEN_ID_LIST)),
        ("logprobs", MAX_LOGPROBS, str(MAX_LOGPROBS)), ("prompt_logprobs", MAX_LOGPROBS, str(MAX_LOGPROBS)),
        ("seed", MAX_SEED, "2\\*\\*64 - 1")]


@pytest.mark.parametrize("field,at_cap,cap", CAPS)
def test_list_and_string_fields_are_capped(field, at_cap, cap):
    """At its cap a field is accepted; one more entry, character or unit is a ValueError naming field and cap."""
    SamplingParams(**{field: at_cap})
    if isinstance(at_cap, dict):
        over = {**at_cap, len(at_cap): 1.0}
    elif isinstance(at_cap, int):
        over = at_cap + 1
    elif len(at_cap) == 1 and isinstance(at_cap[0], str):
        over = [at_cap[0] + "x"]
    else:
        over = at_cap + at_cap[:1]
    with pytest.raises(ValueError, match=f"SamplingParams.{field} .*{cap}"):
        SamplingParams(**{field: over})


def test_a_seed_torch_cannot_take_fails_its_request_alone(llm):
    """A seed of 2**64 passed validation and raised inside the step, failing every request in flight."""
    with pytest.raises(ValueError, match="SamplingParams.seed"):
        SamplingParams(seed=2**64)
    engine = llm.engine
    engine.add_request("fine", "The rain in spain", GREEDY)
    params = SamplingParams(temperature=1.0, max_tokens=4)
    params.seed = 2**64  # past validation (a caller mutating its params): the engine still refuses it at add time
    with pytest.raises(ValueError, match="SamplingParams.seed"):
        engine.add_request("bad-seed", "The rain in spain", params)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert outs["fine"].outputs[0].finish_reason == "length" and "bad-seed" not in outs


def test_bad_prompt_in_a_batch_names_its_index_and_runs_nothing(llm):
    with pytest.raises(ValueError, match="prompt 2: .*empty"):
        llm.generate(["good one", "another good one", "", "never runs"], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate(["still serving"], GREEDY, use_tqdm=False)[0].finished


def test_bad_request_rejected_while_others_keep_running(llm, bart_path, make_llm):
    engine = llm.engine
    prompts = ["The rain in spain", "falls mainly on the plain", "meeting notes quickly"]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    for i, p in enumerate(prompts):
        engine.add_request(f"ok{i}", p, GREEDY)
    engine.step()
    engine.step()
    for bad in ("", {"prompt_token_ids": [10**6]}):
        with pytest.raises(ValueError):
            engine.add_request("bad", bad, GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok0", "dup", GREEDY)
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.add_request("wide", "x", SamplingParams(max_tokens=2, best_of=300, n=1))
    small = make_llm(bart_path, num_kv_blocks=20).engine  # 16 cross blocks + 1 + 7 forks > 20
    with pytest.raises(ValueError, match="needs 24 KV blocks \\(16 cross\\) but the pool has only 20"):
        small.add_request("huge", {"prompt_token_ids": [5] * 256}, SamplingParams(max_tokens=2, best_of=8, n=1))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    assert [finished[f"ok{i}"] for i in range(3)] == expected


def test_abort_mid_decode_frees_blocks(llm):
    engine = llm.engine
    engine.add_request("a", "The rain in spain falls mainly", SamplingParams(temperature=0, max_tokens=50))
    engine.add_request("b", "on the plain", SamplingParams(temperature=0, max_tokens=3))
    engine.step()
    engine.step()
    out = engine.abort_request("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_free_blocks() == engine.num_total_blocks()


class _DecoderOnly:
    is_encoder_decoder = False


def test_explicit_prompt_on_decoder_only_model_is_an_error():
    proc = InputProcessor(_DecoderOnly(), None, 100, 64, 0, None, None, None)
    with pytest.raises(ValueError, match="decoder-only"):
        proc.process({"encoder_prompt": {"prompt_token_ids": [1]}, "decoder_prompt": None}, GREEDY)
    assert proc.process({"prompt_token_ids": [1, 2]}, GREEDY).decoder_token_ids == [1, 2]


def test_decoder_only_truncation_leaves_room_to_generate():
    proc = InputProcessor(_DecoderOnly(), None, 100, 64, 0, None, None, None)
    with pytest.raises(ValueError, match="limit of 63.*truncate_prompt_tokens=63"):
        proc.process({"prompt_token_ids": [1] * 80}, GREEDY)
    params = SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=64)
    assert len(proc.process({"prompt_token_ids": [1] * 80}, params).decoder_token_ids) == 63
