"""Bad input gets a clear ValueError naming the problem and never hurts other requests."""

import pytest

from encdec_engine import SamplingParams
from encdec_engine.inputs.preprocess import InputProcessor

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
        (dict(early_stopping="sometimes"), "early_stopping"),
    ],
)
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


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
