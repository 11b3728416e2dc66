"""The server's OpenAPI document, describing the bodies it really takes and gives.

FastAPI derives most of it from the pydantic models; this adds what it cannot see: the
multipart upload of the audio endpoints (they parse their form themselves), every
response's media types (JSON, plain text for text/srt/vtt, server-sent events when
streaming), the OpenAI-shaped error bodies with the statuses each operation answers
(400 instead of FastAPI's 422), and only the endpoints the loaded model serves.
`tests/test_fuzz_server.py` runs schemathesis against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from encdec_engine.server import protocol as P
from encdec_engine.server import routes

_ERRORS = {
    400: "a field has a wrong type or value, the body cannot be parsed, or the engine rejects the prompt",
    401: "the API key is missing or wrong (when the server has one)",
    403: "the Host or Origin header is not served here (a web page's request: see --allowed-hosts, --allowed-origins)",
    404: "an unknown model name, or an endpoint the loaded model does not serve",
    413: "the body (or the audio) is over the server's limit",
    429: "the server's queue is full; retry after Retry-After",
    500: "an internal error; the body names a request id the server log has the traceback under",
    503: "the engine is not running",
}
_POST_ERRORS = (400, 401, 403, 404, 413, 429, 500, 503)
_GET_ERRORS = (401, 403, 404, 500)
_TEXT = {"schema": {"type": "string"}}
# text/event-stream: before OpenAPI 3.2 (no `itemSchema`) a stream's schema describes each event.
_EVENTS = {"schema": {"type": "object", "required": ["data"],
                      "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                                     "id": {"type": "string"}, "retry": {"type": "integer"}}}}


# What the schema cannot say (rules between fields, the content of a file, the model's tokenizer): each
# is a 400 whose message starts as written here. tests/test_fuzz_server.py holds every 400 that a
# schema-valid request gets to this list.
SEMANTIC_RULES = {
    "completions": (
        "max_tokens N plus the N-token decoder prompt is more than the model's limit",
        "SamplingParams.min_tokens must be <= max_tokens",
        "best_of must be",
        "best_of must equal n when streaming",
        "stream_options needs stream=true",
        "this request may generate",
        "prompt N: ", "encoder prompt: ", "decoder prompt: ",  # the prompt as the engine reads it
        "prompt has N tokens", "decoder_prompt has N tokens",  # beyond the model's positions
        "logit_bias: token id",
        "SamplingParams.",
        "target_language", "source_language",  # a language the model does not have, a model that does not translate
        "a text to translate is empty",
    ),
    "audio": (
        "cannot decode the uploaded audio",
        "the uploaded file",
        "stream=true sends transcript.text events",
        "chunking_strategy is not supported with stream=true",
        "timestamp_granularities need response_format verbose_json",
        "this checkpoint is English-only",
        "max_completion_tokens N plus the window's",
        "audio is",
        "prompt: ",
    ),
}


@dataclass(frozen=True)
class ModelFacts:
    """What the loaded model adds to the schema: token ids below `vocab_size`, at most `max_decoder_len`
    tokens, the languages a Whisper checkpoint takes."""

    is_audio: bool
    vocab_size: int
    max_decoder_len: int
    max_prompts: int = P.MAX_PROMPTS  # prompts in one request (the admission queue's size, at most)
    languages: tuple[str, ...] = ()  # codes and names (lowercase and capitalized); empty: not Whisper
    window_prompt_len: int = 0  # the longest decoder prompt of a Whisper window (start, language, task, no timestamps)


def install_openapi(app: FastAPI, facts: ModelFacts) -> None:
    """Replace `app.openapi` with the described schema (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            app.openapi_schema = describe(schema, facts)
        return app.openapi_schema

    app.openapi = openapi


def describe(schema: dict[str, Any], facts: ModelFacts) -> dict[str, Any]:
    audio = facts.is_audio
    paths = schema["paths"]
    for path in routes.TEXT_PATHS if audio else routes.AUDIO_PATHS:
        paths.pop(path, None)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(_model_schemas(P.ErrorResponse, P.TranscriptionResponse, P.TranscriptionVerboseResponse))
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for path, operations in paths.items():
        for method, op in operations.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)  # validation errors are 400s here, in OpenAI's shape
            for status in _POST_ERRORS if method == "post" else _GET_ERRORS:
                responses.setdefault(str(status), {"description": _ERRORS[status], "content": error})
    if routes.COMPLETIONS in paths:
        op = paths[routes.COMPLETIONS]["post"]
        op["responses"]["200"]["content"]["text/event-stream"] = _EVENTS  # `data: {chunk}` events, `data: [DONE]`
        _document_rules(op, "completions")
        _bound_completions(components["CompletionRequest"], facts)
    for path in routes.AUDIO_PATHS:
        if path in paths:
            _describe_audio(paths[path]["post"], path.endswith("transcriptions"), facts)
            _document_rules(paths[path]["post"], "audio")
    _describe_health_and_metrics(paths)
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    return schema


def _model_schemas(*models) -> dict[str, Any]:
    """The component schemas of pydantic models (and the models they use), with OpenAPI refs."""
    out: dict[str, Any] = {}
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
        out.update(schema.pop("$defs", {}))
        out[model.__name__] = schema
    return out


def _document_rules(op: dict[str, Any], kind: str) -> None:
    rules = "; ".join(f"'{r}...'" for r in SEMANTIC_RULES[kind])
    op["responses"]["400"]["description"] += f". Beyond the schema, a 400 whose message starts: {rules}"


def _bound_completions(request: dict[str, Any], facts: ModelFacts) -> None:
    """Token ids below the vocabulary's size, max_tokens within the model's positions."""
    properties = request["properties"]
    for alternative in properties["prompt"]["anyOf"]:  # a list of prompts: no more than the queue takes
        if alternative.get("type") == "array" and "maxItems" in alternative:
            alternative["maxItems"] = min(alternative["maxItems"], facts.max_prompts)
    for name in ("prompt", "stop_token_ids"):
        _bound_integers(properties[name], facts.vocab_size - 1)
    _bound_integers(properties["max_tokens"], facts.max_decoder_len)


def _bound_integers(schema: Any, maximum: int) -> None:
    if isinstance(schema, dict):
        if schema.get("type") == "integer":
            schema["maximum"] = min(maximum, schema.get("maximum", maximum))
        for value in schema.values():
            _bound_integers(value, maximum)
    elif isinstance(schema, list):
        for value in schema:
            _bound_integers(value, maximum)


def _describe_audio(op: dict[str, Any], transcription: bool, facts: ModelFacts) -> None:
    """The multipart form the endpoint parses itself: the file plus the fields of its request model. A
    form has no null: an optional field is left out instead."""
    model = P.TranscriptionRequest if transcription else P.TranslationRequest
    fields = model.model_json_schema()
    properties = {"file": {"type": "string", "format": "binary", "minLength": 1,
                           "description": "the audio: any format ffmpeg or libsndfile reads"}}
    for name, field in fields["properties"].items():
        if name == "timestamp_granularities":  # sent as repeated `timestamp_granularities[]` parts
            name = "timestamp_granularities[]"
        properties[name] = _without_null(_inline_defs(field, fields.get("$defs", {})))
    if "language" in properties:
        properties["language"] = {"type": "string", "enum": list(facts.languages),
                                  "description": "a language code or name this checkpoint takes"}
    _bound_integers(properties["max_completion_tokens"], facts.max_decoder_len - facts.window_prompt_len)
    op["requestBody"] = {"required": True, "content": {"multipart/form-data": {"schema": {
        "type": "object", "properties": properties, "required": ["file"], "additionalProperties": False}}}}
    json_schema = {"anyOf": [{"$ref": "#/components/schemas/TranscriptionResponse"},
                             {"$ref": "#/components/schemas/TranscriptionVerboseResponse"}]}
    op["responses"]["200"] = {
        "description": "json / verbose_json: the transcript; text, srt, vtt: the text; stream=true: "
                       "transcript.text.delta events, then transcript.text.done",
        "content": {"application/json": {"schema": json_schema}, "text/plain": _TEXT, "text/event-stream": _EVENTS}}


def _without_null(schema: dict[str, Any]) -> dict[str, Any]:
    options = [s for s in schema.get("anyOf", ()) if s.get("type") != "null"]
    if not options or len(options) == len(schema["anyOf"]):
        return schema
    rest = {k: v for k, v in schema.items() if k not in ("anyOf", "default")}
    return {**options[0], **rest} if len(options) == 1 else {"anyOf": options, **rest}


def _inline_defs(schema: Any, defs: dict[str, Any]) -> Any:
    """`schema` with its `#/$defs/...` references (nested models: chunking_strategy's server_vad object)
    replaced by the definitions, which have no place of their own in a form's schema. In a multipart form
    such an object is sent as a JSON part (OpenAPI's default), which the endpoint reads."""
    if isinstance(schema, dict):
        ref = schema.get("$ref", "")
        if ref.startswith("#/$defs/"):
            return _inline_defs(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline_defs(v, defs) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_inline_defs(v, defs) for v in schema]
    return schema


def _describe_health_and_metrics(paths: dict[str, Any]) -> None:
    health = {"type": "object", "required": ["status"],
              "properties": {"status": {"type": "string", "enum": ["ok", "unavailable"]},
                             "reason": {"type": "string"}}}
    if routes.HEALTH in paths:
        paths[routes.HEALTH]["get"]["responses"] = {
            "200": {"description": "the engine thread runs", "content": {"application/json": {"schema": health}}},
            "503": {"description": "the engine has stopped", "content": {"application/json": {"schema": health}}}}
    if routes.METRICS in paths:
        responses = paths[routes.METRICS]["get"]["responses"]
        responses["200"] = {"description": "Prometheus text format", "content": {"text/plain": _TEXT}}
