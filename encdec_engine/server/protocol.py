"""Request and response schemas of the OpenAI-compatible server (pydantic, validated at the edge).

Field names and shapes follow OpenAI's API so its official client works unchanged;
the extra sampling fields of `/v1/completions` follow vLLM's names. A request that
does not validate gets a 400 naming the field, never a 500.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from encdec_engine.checkpoints.whisper.languages import LANGUAGES
from encdec_engine.outputs import RequestOutput
from encdec_engine.sampling_params import (MAX_BAD_WORD_CHARS, MAX_BAD_WORDS, MAX_LOGIT_BIAS,
                                           MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
                                           SamplingParams)
from encdec_engine.inputs.audio import FRAMES_PER_SECOND
from encdec_engine.speech.results import Transcription

# Caps on the request bodies (each over its cap is a 400 naming the field; the sampling fields' caps
# are SamplingParams'). Far above real use; they bound what one request can make the server hold or do.
MAX_PROMPTS = 256  # prompts in one completion request
MAX_N = 16  # completions per prompt
MAX_PROMPT_CHARS = 1_000_000  # one text prompt (tokenized in a worker thread, never on the event loop)
MAX_PROMPT_TOKEN_IDS = 1 << 18  # one token id prompt (truncate_prompt_tokens may cut a long one)
MAX_NAME_CHARS = 256  # model, user
MAX_AUDIO_PROMPT_CHARS = 8192  # a transcription's prompt (Whisper keeps its last 223 tokens)
MAX_LANGUAGE_CHARS = 32
# Seeds a JSON number carries exactly, as an integer or as a float (2^53 - 1); SamplingParams takes up to 2^64 - 1.
MAX_JSON_SEED = 2**53 - 1


# -- errors -----------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str  # invalid_request_error | authentication_error | not_found_error | ...
    param: str | None = None
    code: int | None = None  # the HTTP status


class ErrorResponse(BaseModel):
    error: ErrorInfo


def describe_validation_errors(errors: list[dict]) -> tuple[str, str | None]:
    """pydantic's errors -> one message naming each bad field, and the first field's name. Of the errors
    a union field gets (one per alternative), only the deepest are kept: `stop.1: ...` says more than
    `stop: Input should be a valid string`; pydantic's type tags are left out of the field paths."""
    found, param = [], None
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _is_type_tag(x)]
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if err.get("type") == "json_invalid":
            msg, loc = f"the body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')})", []
        found.append((loc, msg))
        param = param or (loc[0] if loc else None)
    depth: dict[str, int] = {}
    for loc, _ in found:
        key = loc[0] if loc else ""
        depth[key] = max(depth.get(key, 0), len(loc))
    parts = list(dict.fromkeys(f"{'.'.join(loc)}: {msg}" if loc else msg for loc, msg in found
                               if len(loc) == depth[loc[0] if loc else ""]))
    return "; ".join(parts) or "invalid request", param


def _is_type_tag(part) -> bool:
    """pydantic names the alternative of a union an error comes from ('str', 'list[constrained-str]')."""
    return isinstance(part, str) and part != "[key]" and (
        any(c in part for c in "[]-") or part in ("str", "int", "float", "bool", "list", "dict", "none"))


# -- completions ------------------------------------------------------------
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False  # a last chunk with `usage` and no choices
    continuous_usage_stats: bool = False  # vLLM: every chunk carries the usage so far too


def json_int(value: Any) -> Any:
    """JSON Schema's integer includes 1.0 (a number without a fraction); pydantic's strict int does not."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _token_list(value: Any) -> Any:
    """A list of JSON integers (1.0 included) as a list of ints; anything else as it is."""
    if isinstance(value, list) and value and all(isinstance(json_int(t), int) and not isinstance(t, bool)
                                                 for t in value):
        return [json_int(t) for t in value]
    return value


def _singleton(value: Any, what: str) -> str | dict:
    """A string, a token id list, {"prompt": str} or {"prompt_token_ids": [int]} -> an engine prompt."""
    value = _token_list(value)
    if isinstance(value, str):
        if not value:
            raise ValueError(f"{what} is an empty string")
        if len(value) > MAX_PROMPT_CHARS:
            raise ValueError(f"{what} has {len(value)} characters, more than the limit of {MAX_PROMPT_CHARS}")
        return value
    if _is_token_list(value):
        if not value:
            raise ValueError(f"{what} is an empty list of token ids")
        if len(value) > MAX_PROMPT_TOKEN_IDS:
            raise ValueError(f"{what} has {len(value)} token ids, more than the limit of {MAX_PROMPT_TOKEN_IDS}")
        return {"prompt_token_ids": value}
    if isinstance(value, dict) and set(value) == {"prompt"}:
        if not isinstance(value["prompt"], str):  # not token ids under the text's key
            raise ValueError(f"{what}.prompt must be a string, got {type(value['prompt']).__name__}")
        return _singleton(value["prompt"], what)
    if isinstance(value, dict) and set(value) == {"prompt_token_ids"}:
        ids = _token_list(value["prompt_token_ids"])
        if not _is_token_list(ids):  # not text under the token ids' key ("abc" was taken as a text prompt)
            raise ValueError(f"{what}.prompt_token_ids must be a list of token ids, got {type(ids).__name__}")
        return _singleton(ids, what)
    raise ValueError(f"{what} must be a string, a list of token ids, {{\"prompt\": str}} or "
                     f"{{\"prompt_token_ids\": [int, ...]}}, got {type(value).__name__}")


def _one_prompt(value: Any, what: str) -> str | dict:
    if isinstance(value, dict) and "encoder_prompt" in value:
        extra = set(value) - {"encoder_prompt", "decoder_prompt"}
        if extra:
            raise ValueError(f"{what} has unknown keys {sorted(extra)}; expected encoder_prompt and decoder_prompt")
        decoder = value.get("decoder_prompt")
        return {"encoder_prompt": _singleton(value["encoder_prompt"], f"{what}.encoder_prompt"),
                "decoder_prompt": None if decoder is None else _singleton(decoder, f"{what}.decoder_prompt")}
    return _singleton(value, what)


def parse_prompts(value: Any) -> list[str | dict]:
    """OpenAI's `prompt` (string, list of strings, token ids, list of token id lists) plus explicit
    `{"encoder_prompt": ..., "decoder_prompt": ...}` objects (alone or in a list) -> engine prompts."""
    value = _token_list(value)
    if isinstance(value, list) and value and not _is_token_list(value):
        if len(value) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(value)}")
        return [_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(value)]
    return [_one_prompt(value, "prompt")]


def _prompt_json_schema() -> dict:
    """The JSON schema of `prompt`, for the OpenAPI document (parse_prompts does the validating)."""
    text = {"type": "string", "minLength": 1, "maxLength": MAX_PROMPT_CHARS}
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1, "maxItems": MAX_PROMPT_TOKEN_IDS}
    singleton = {"anyOf": [
        text, ids,
        {"type": "object", "properties": {"prompt": text}, "required": ["prompt"], "additionalProperties": False},
        {"type": "object", "properties": {"prompt_token_ids": ids}, "required": ["prompt_token_ids"],
         "additionalProperties": False}]}
    explicit = {"type": "object", "additionalProperties": False, "required": ["encoder_prompt"],
                "properties": {"encoder_prompt": singleton, "decoder_prompt": {"anyOf": [singleton, {"type": "null"}]}}}
    one = {"anyOf": [singleton, explicit]}
    return {"anyOf": [one, {"type": "array", "items": one, "minItems": 1, "maxItems": MAX_PROMPTS}],
            "description": "string, list of strings, token ids, list of token id lists, or "
                           "{'encoder_prompt': ..., 'decoder_prompt': ...} (or a list of them)"}


StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
BadWord = Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]
TokenId = Annotated[int, Field(ge=0)]
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]+$", max_length=20)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
LogitBias = Annotated[dict[TokenIdKey, Bias], Field(max_length=MAX_LOGIT_BIAS), WithJsonSchema({
    "type": "object", "maxProperties": MAX_LOGIT_BIAS, "propertyNames": {"pattern": "^[0-9]{1,20}$"},
    "additionalProperties": {"type": "number", "minimum": -100.0, "maximum": 100.0},
    "description": "token id (as a string) -> bias in [-100, 100]"})]


class CompletionRequest(BaseModel):
    """`POST /v1/completions`. For an encoder/decoder model the prompt is the encoder prompt. Strict, as
    JSON is typed: "16" is not an integer (the OpenAPI document says which types each field takes)."""

    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    prompt: Annotated[Any, WithJsonSchema(_prompt_json_schema())]
    max_tokens: int | None = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_JSON_SEED)
    logprobs: int | None = Field(None, ge=0, le=5)  # OpenAI's limit for completions
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=MAX_NAME_CHARS)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: LogitBias | None = None
    # OpenAI fields accepted only at their neutral value (the schema says so; the 400 names them).
    echo: bool = Field(False, json_schema_extra=lambda s: _only(s, {"type": "boolean", "const": False}))
    suffix: str | None = Field(None, json_schema_extra=lambda s: _only(s, {"type": "null"}))
    # vLLM's extra sampling fields.
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    no_repeat_ngram_size: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    bad_words: list[BadWord] | None = Field(None, max_length=MAX_BAD_WORDS)
    # Translation (T5, mT5, Marian, mBART, M2M100, NLLB): text prompts are told the languages the model's way
    # (translation/conventions.py) and the target's code is forced first where the model wants it.
    target_language: str | None = Field(None, min_length=1, max_length=MAX_LANGUAGE_CHARS)
    source_language: str | None = Field(None, min_length=1, max_length=MAX_LANGUAGE_CHARS)

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=lambda s: _nullable_optionals(s))

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI's optional fields are nullable: null takes the default (the schema says so for each), but
        max_tokens: null means no limit but the model's. An integer field takes a JSON number without a
        fraction (1.0), as JSON Schema's integer does."""
        if isinstance(data, dict):
            fields = cls.model_fields
            data = {k: v for k, v in data.items()
                    if v is not None or k not in fields or fields[k].default is None or k == "max_tokens"}
            for name in _INTEGER_FIELDS & data.keys():
                value = data[name]
                data[name] = [json_int(v) for v in value] if isinstance(value, list) else json_int(value)
        return data

    @field_validator("prompt", mode="before")
    @classmethod
    def _parse_prompt(cls, value: Any) -> list[str | dict]:
        return parse_prompts(value)

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        unsupported = {"echo": self.echo, "suffix": self.suffix is not None}
        named = [name for name, used in unsupported.items() if used]
        if named:
            raise ValueError(f"not supported by this server: {', '.join(named)} (leave at the default)")
        if self.stream and self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of must equal n when streaming")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream=true")
        if self.source_language is not None and self.target_language is None:
            raise ValueError("source_language needs target_language")
        return self

    def sampling_params(self) -> SamplingParams:
        """Raises ValueError (a 400) for combinations SamplingParams rejects."""
        return SamplingParams(
            n=self.n, best_of=self.best_of, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=self.seed, max_tokens=self.max_tokens, min_tokens=self.min_tokens,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, no_repeat_ngram_size=self.no_repeat_ngram_size,
            logit_bias={int(t): b for t, b in self.logit_bias.items()} if self.logit_bias else None,
            bad_words=self.bad_words, logprobs=self.logprobs, skip_special_tokens=self.skip_special_tokens,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
        )


_INTEGER_FIELDS = frozenset({"max_tokens", "n", "best_of", "seed", "logprobs", "top_k", "min_tokens",
                             "no_repeat_ngram_size", "stop_token_ids", "truncate_prompt_tokens"})


def _only(schema: dict, accepted: dict) -> None:
    """A field's JSON schema replaced by `accepted` (its title and default kept)."""
    keep = {k: schema[k] for k in ("title", "default") if k in schema}
    schema.clear()
    schema.update(accepted, **keep)


def _nullable_optionals(schema: dict) -> None:
    """Every optional field takes null (as its default): say so where the field's own schema does not."""
    required = set(schema.get("required", ()))
    for name, field in schema["properties"].items():
        if name in required or _allows_null(field):
            continue
        keep = {k: field.pop(k) for k in ("title", "default", "description") if k in field}
        schema["properties"][name] = {"anyOf": [field, {"type": "null"}], **keep}


def _allows_null(schema: dict) -> bool:
    return schema.get("type") == "null" or any(_allows_null(s) for s in schema.get("anyOf", ()))


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int  # prompt_index * n + completion_index
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None


class Usage(BaseModel):
    prompt_tokens: int  # encoder prompt + decoder prompt tokens
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


def usage_of(outputs: list[RequestOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) + len(o.encoder_prompt_token_ids or []) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, float]], decode: Callable[[int], str],
                        text_offset: int = 0, text_of: Callable[[int], str] | None = None) -> CompletionLogprobs:
    """The engine's per-token {token_id: logprob} (sampled token + top-k) in OpenAI's layout. JSON has
    no -inf or NaN: such a log-probability (a banned token, degenerate sampling values) is -9999.0, as
    vLLM sends it. Each token is shown as `decode` writes it (special tokens included); its text offset
    advances by what it adds to the completion's text (`text_of`: special tokens, which the text skips,
    add nothing)."""
    lp = CompletionLogprobs()
    text_of = text_of or decode
    for token, top in zip(token_ids, logprobs):
        piece = decode(token)
        lp.tokens.append(piece)
        lp.token_logprobs.append(_json_logprob(top.get(token, -math.inf)))
        ranked: dict[str, float] = {}
        for t, v in sorted(top.items(), key=lambda item: -_json_logprob(item[1])):  # most likely first; pieces
            ranked.setdefault(decode(t), _json_logprob(v))  # that decode alike (partial UTF-8) keep the likeliest
        lp.top_logprobs.append(ranked)
        lp.text_offset.append(text_offset)
        text_offset += len(text_of(token))
    return lp


def _json_logprob(value: float) -> float:
    return value if math.isfinite(value) else -9999.0


# -- audio ------------------------------------------------------------------
AudioResponseFormat = Literal["json", "text", "srt", "vtt", "verbose_json"]


class TranslationRequest(BaseModel):
    """The form fields of `POST /v1/audio/translations` (the file travels beside them)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    prompt: str | None = Field(None, max_length=MAX_AUDIO_PROMPT_CHARS)  # text that conditions the first window
    response_format: AudioResponseFormat = "json"
    temperature: float = Field(0.0, ge=0.0, le=1.0)  # 0: greedy with temperature fallback
    # vLLM's transcription fields: tokens per window, the penalty, and beam search at temperature 0
    # (beam_size alone, or use_beam_search with openai-whisper's CLI default of 5 beams).
    max_completion_tokens: int | None = Field(None, ge=1)
    repetition_penalty: float | None = Field(None, gt=0.0)
    use_beam_search: bool = False
    beam_size: int | None = Field(None, ge=1, le=16)
    length_penalty: float | None = Field(None, ge=0.0, le=1.0)  # ranking of beams and samples (openai-whisper)

    def decoding_options(self) -> dict[str, Any]:
        """The TranscribeOptions these fields set."""
        beams = self.beam_size or (5 if self.use_beam_search else 1)
        options: dict[str, Any] = {"beam_size": beams, "length_penalty": self.length_penalty,
                                   "max_new_tokens": self.max_completion_tokens}
        if self.repetition_penalty is not None:
            options["repetition_penalty"] = self.repetition_penalty
        return options


class ServerVadChunking(BaseModel):
    """OpenAI's `chunking_strategy` object: Silero VAD finds the speech, which is decoded in chunks of at
    most 30 s at once. Defaults: those OpenAI documents for its server_vad (its Realtime API)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["server_vad"]
    threshold: float = Field(0.5, ge=0.0, le=1.0)  # speech probability at or above which a frame is speech
    # audio kept before (and after) the speech heard; a 30 s chunk must hold it twice and a 32 ms frame
    prefix_padding_ms: int = Field(300, ge=0, le=14_983)
    silence_duration_ms: int = Field(500, ge=0)  # silence this long ends speech

    @property
    def vad_parameters(self) -> dict[str, float]:
        """The fields under faster-whisper's names (TranscribeOptions.vad_parameters)."""
        return {"threshold": self.threshold, "speech_pad_ms": self.prefix_padding_ms,
                "min_silence_duration_ms": self.silence_duration_ms}


class TranscriptionRequest(TranslationRequest):
    """The form fields of `POST /v1/audio/transcriptions`."""

    # ISO-639-1 code; None: English-only models use English, others detect
    language: str | None = Field(None, max_length=MAX_LANGUAGE_CHARS)
    timestamp_granularities: list[Literal["segment", "word"]] = Field(default_factory=list, max_length=2)
    stream: bool = False
    # OpenAI's field: "auto" cuts audio over 30 s at its quietest moments and decodes the chunks at once
    # (TranscribeOptions.chunked); server_vad decodes only the speech Silero VAD finds, in chunks of at most
    # 30 s at once (vad_filter and chunked). Absent: windows one after another, each conditioned on the text
    # before. In a multipart form the object comes as chunking_strategy[type]=server_vad, ... (OpenAI's
    # client) or as one JSON text.
    chunking_strategy: Literal["auto"] | ServerVadChunking | None = None

    @field_validator("chunking_strategy", mode="before")
    @classmethod
    def _chunking_object(cls, value: Any) -> Any:
        if isinstance(value, str) and value.lstrip().startswith("{"):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"not valid JSON ({e})") from None
        if isinstance(value, dict):  # its own errors, named by field, instead of the union's
            try:
                return ServerVadChunking.model_validate(value)
            except ValueError as e:
                raise ValueError(describe_validation_errors(e.errors())[0]) from None
        if value not in (None, "auto"):
            raise ValueError(f'must be "auto" or an object with "type": "server_vad", got {value!r}')
        return value

    @model_validator(mode="after")
    def _stream_formats(self) -> TranscriptionRequest:
        if self.stream and self.response_format not in ("json", "text"):
            raise ValueError(f"stream=true sends transcript.text events; response_format must be json or text, "
                             f"got {self.response_format!r}")
        if self.stream and self.chunking_strategy is not None:
            raise ValueError("chunking_strategy is not supported with stream=true (a stream sends windows in order)")
        if self.timestamp_granularities and self.response_format != "verbose_json":
            raise ValueError(f"timestamp_granularities need response_format verbose_json, "
                             f"got {self.response_format!r}")
        return self

    @property
    def words(self) -> bool:
        return "word" in self.timestamp_granularities


class TranscriptionSegment(BaseModel):
    id: int
    seek: int  # mel frame (10 ms) where the segment starts
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float


class TranscriptionWord(BaseModel):
    word: str
    start: float
    end: float


class AudioUsage(BaseModel):
    type: Literal["duration"] = "duration"
    seconds: float


class TranscriptionResponse(BaseModel):
    text: str
    usage: AudioUsage | None = None


class TranscriptionVerboseResponse(BaseModel):
    task: Literal["transcribe", "translate"]
    language: str  # the language's English name, as OpenAI gives it ("english")
    duration: float
    text: str
    segments: list[TranscriptionSegment] | None = None  # absent when only word timestamps were asked for
    words: list[TranscriptionWord] | None = None  # timestamp_granularities[]=word
    usage: AudioUsage | None = None


def audio_usage(t: Transcription) -> AudioUsage:
    return AudioUsage(seconds=math.ceil(t.duration))


def language_name(code: str | None) -> str:
    """"en" -> "english", as OpenAI names languages."""

    return LANGUAGES.get(code or "en", code or "english")


def verbose_transcription(t: Transcription, task: str, granularities: list[str] = ()) -> TranscriptionVerboseResponse:
    """OpenAI's verbose_json: segments (the default granularity), words when asked for."""
    segments = [TranscriptionSegment(id=s.id, seek=round(s.start * FRAMES_PER_SECOND), start=s.start, end=s.end,
                                     text=s.text, tokens=s.tokens, temperature=s.temperature,
                                     avg_logprob=s.avg_logprob, compression_ratio=s.compression_ratio,
                                     no_speech_prob=s.no_speech_prob) for s in t.segments]
    language = "english" if task == "translate" else language_name(t.language)  # OpenAI: translations are English
    words = None
    if "word" in granularities:
        words = [TranscriptionWord(word=w.word.strip(), start=w.start, end=w.end)
                 for s in t.segments for w in s.words or ()]
    if granularities and "segment" not in granularities:
        segments = None
    return TranscriptionVerboseResponse(task=task, language=language, duration=t.duration, text=t.text.strip(),
                                        segments=segments, words=words, usage=audio_usage(t))


class TranscriptDelta(BaseModel):
    type: Literal["transcript.text.delta"] = "transcript.text.delta"
    delta: str


class TokenUsage(BaseModel):
    type: Literal["tokens"] = "tokens"
    input_tokens: int  # decoder prompt tokens + encoder positions (audio tokens)
    output_tokens: int
    total_tokens: int


class TranscriptDone(BaseModel):
    type: Literal["transcript.text.done"] = "transcript.text.done"
    text: str
    usage: TokenUsage | None = None


# -- models -----------------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "encdec-engine"
    root: str | None = None  # the checkpoint folder's name (not its path: where the server keeps its files)
    max_model_len: int | None = None  # decoder positions


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
