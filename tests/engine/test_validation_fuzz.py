"""Property-based: any input to the prompt parsers, SamplingParams, the completion request body or
`LLMEngine.process_request` is accepted or refused with a ValueError (a 400 from the server) that
names the field; never another exception."""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from encdec_engine import SamplingParams
from encdec_engine.server.protocol import CompletionRequest, describe_validation_errors, parse_prompts
from encdec_engine.inputs.prompts import parse_prompt

SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.integers(-3, 40)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=5)
                    | st.dictionaries(st.text(max_size=16) | st.sampled_from(["prompt", "prompt_token_ids",
                                                                              "encoder_prompt", "decoder_prompt"]),
                                      inner, max_size=4), max_leaves=16)
TOKEN_IDS = st.lists(st.integers(-2, 700), max_size=12)
PROMPT_LIKE = st.one_of(
    JSON, st.text(max_size=40), TOKEN_IDS,
    st.fixed_dictionaries({"prompt": st.text(max_size=40) | JSON}),
    st.fixed_dictionaries({"prompt_token_ids": TOKEN_IDS | JSON}),
    st.fixed_dictionaries({"encoder_prompt": st.text(max_size=20) | TOKEN_IDS.map(lambda t: {"prompt_token_ids": t})
                           | JSON, "decoder_prompt": st.none() | st.text(max_size=20) | JSON}))
FIELDS = [f.name for f in dataclasses.fields(SamplingParams) if f.init]
# Values a field plausibly takes, so that generated params also get past the type checks.
PLAUSIBLE = st.one_of(st.integers(-2, 30), st.floats(-3, 3), st.lists(st.integers(-1, 700), max_size=6),
                      st.lists(st.text(max_size=6), max_size=4), st.dictionaries(st.integers(-1, 700), st.floats(), max_size=3),
                      st.sampled_from([True, False, "never", None, range(5), [(0, 0)], [(9, 9)], 2**64]))
PARAMS = st.dictionaries(st.sampled_from(FIELDS), PLAUSIBLE | JSON, max_size=6)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))


def names_a_field(message: str, fields) -> bool:
    return any(re.search(rf"\b{re.escape(f)}\b", message) for f in fields)


@pytest.mark.parametrize("parser", [parse_prompt, parse_prompts], ids=["engine", "completions"])
@FUZZ
@given(prompt=PROMPT_LIKE)
def test_the_prompt_parsers_accept_or_name_the_problem(parser, prompt):
    try:
        parser(prompt)
    except ValueError as e:
        assert names_a_field(str(e), ["prompt", "encoder_prompt", "decoder_prompt", "prompt_token_ids",
                                      "multi_modal_data"]) or re.search(r"\bprompt\[\d+\]", str(e)), str(e)


@FUZZ
@given(kwargs=PARAMS)
def test_sampling_params_accept_or_name_the_field(kwargs):
    try:
        SamplingParams(**kwargs)
    except ValueError as e:
        assert names_a_field(str(e), [f"SamplingParams.{f}" for f in kwargs]), str(e)


@FUZZ
@given(body=st.dictionaries(st.sampled_from(list(CompletionRequest.model_fields) + ["colour"]), PLAUSIBLE | JSON,
                            max_size=6).map(lambda b: {"prompt": "x", **b}))
def test_completion_bodies_are_accepted_or_a_400_naming_the_field(body):
    try:
        CompletionRequest.model_validate(body).sampling_params()
    except ValidationError as e:  # the server's 400 message
        message, _ = describe_validation_errors(e.errors())
        assert names_a_field(message, list(body)), message
    except ValueError as e:
        assert names_a_field(str(e), [f"SamplingParams.{f}" for f in FIELDS] + list(body)), str(e)


@pytest.fixture(scope="module")
def engine(bart_path, make_llm):
    return make_llm(bart_path, num_kv_blocks=300).engine


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(prompt=PROMPT_LIKE, kwargs=PARAMS)
def test_process_request_accepts_or_refuses_with_a_value_error(engine, prompt, kwargs):
    """Validation is complete before a request is queued: the engine takes it or says why."""
    try:
        params = SamplingParams(**kwargs)
    except ValueError:
        params = SamplingParams()  # the prompt alone then decides
    try:
        engine.process_request(prompt, params)
        event("accepted")
    except ValueError as e:
        event("refused")
        assert str(e), "an empty error message"
    assert not engine.has_unfinished_requests()
