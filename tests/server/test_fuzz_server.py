"""Schemathesis against the servers' own OpenAPI documents, on loopback.

Every operation of the BART completions server and of the Whisper server gets generated requests,
schema-valid (positive) and schema-violating (negative) ones: no answer may be a server error, every
answer must use a documented status and media type and match its documented schema, and schema-
violating requests must be refused with a 4xx, and schema-valid ones served unless refused for one of the
rules the document states beyond its schema. Afterwards each server still serves and holds no KV
block. The default run is small (a few examples per operation and mode); `-m slow` runs many more.
The examples run per operation are printed.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                               response_schema_conformance, status_code_conformance)
from servers import AUTH, KEY, LiveServer

from encdec_engine.server.app import ServerLimits, build_app
from encdec_engine.server.openapi import SEMANTIC_RULES
from encdec_engine.checkpoints.ct2.importer import default_model_path

pytestmark = pytest.mark.integration  # fuzzing (schemathesis)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def fuzz_servers(bart_path):
    # Short outputs and a small queue keep each generated request cheap; the key guards /metrics too.
    bart = LiveServer(build_app(str(bart_path), limits=ServerLimits(api_key=KEY, max_queue=8),
                                served_model_name="bart", num_kv_blocks=128, max_model_len=24))
    whisper = LiveServer(build_app(str(default_model_path()), kv_cache_space_gb=0.1,
                                   limits=ServerLimits(api_key=KEY, max_upload_mb=0.5, max_audio_seconds=30.0)))
    yield {"bart": bart, "whisper": whisper}
    for server in (bart, whisper):
        server.stop()


def check_accepted(response, rules: tuple[str, ...]) -> None:
    """A schema-valid request is served, or refused for a rule the document states beyond its schema
    (server_openapi.SEMANTIC_RULES: a file that is no audio, rules between fields, the model's length)."""
    if response.status_code in (400, 413, 422):
        message = response.json()["error"]["message"]
        assert any(rule in re.sub(r"\d+", "N", message) for rule in rules), f"a schema-valid request refused: {message}"


def fuzz(server: LiveServer, examples: int) -> Counter:
    """Run `examples` positive and negative examples per operation; returns the count per operation."""
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json", headers=AUTH)
    rules = SEMANTIC_RULES["audio" if server.state.is_audio else "completions"]
    counts: Counter = Counter()
    for result in schema.get_all_operations():
        operation = result.ok()
        has_inputs = bool(len(operation.body) or len(operation.path_parameters) or len(operation.query))
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_inputs else (GenerationMode.POSITIVE,):
            checks = CHECKS + ([negative_data_rejection] if mode == GenerationMode.NEGATIVE else [])

            @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case) -> None:
                response = case.call(base_url=server.url, headers=AUTH, timeout=120)
                # A schema-violating body over the size limit is refused by the gate before it is read
                # (413): a rejection, though not among schemathesis' expected statuses.
                refused_for_size = mode == GenerationMode.NEGATIVE and response.status_code == 413
                case.validate_response(response, checks=CHECKS if refused_for_size else checks)
                if mode == GenerationMode.POSITIVE:
                    check_accepted(response, rules)
                counts[f"{operation.label} {mode.value}"] += 1

            try:
                run()
            except Unsatisfiable:  # nothing breaks the schema of a free-form path parameter (a model name)
                assert mode == GenerationMode.NEGATIVE and not counts[f"{operation.label} {mode.value}"]
    return counts


@pytest.mark.parametrize("kind", ["bart", "whisper"])
def test_schemathesis_finds_no_server_error(fuzz_servers, kind):
    server = fuzz_servers[kind]
    counts = fuzz(server, examples=25)
    print(f"\n{kind}: examples per operation and mode: {dict(counts)}")
    assert len(counts) >= 6  # every operation ran, and those with inputs in both modes
    server.assert_clean()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bart", "whisper"])
def test_schemathesis_finds_no_server_error_long(fuzz_servers, kind):
    server = fuzz_servers[kind]
    counts = fuzz(server, examples=300)
    print(f"\n{kind}: examples per operation and mode: {dict(counts)}")
    server.assert_clean()
