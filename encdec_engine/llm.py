"""The offline Python API: `LLM.generate`, `LLM.summarize`, `LLM.translate`, `LLM.transcribe` and
`LLM.transcribe_live`."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from tqdm.auto import tqdm

from encdec_engine.config import EngineConfig
from encdec_engine.engine.llm_engine import LLMEngine
from encdec_engine.inputs.prompts import PromptType
from encdec_engine.checkpoints.names import DEFAULT_MODEL
from encdec_engine.checkpoints.whisper.tokenizer import WhisperTextTokenizer
from encdec_engine.outputs import RequestOutput
from encdec_engine.sampling_params import SamplingParams
from encdec_engine.inputs.audio import audio_inputs
from encdec_engine.inputs.pcm_stream import AudioChunks
from encdec_engine.speech.live.events import LiveEvent
from encdec_engine.speech.live.model import LiveModel
from encdec_engine.speech.live.options import LiveOptions
from encdec_engine.speech.live.session import LiveSession
from encdec_engine.speech.live.sync_driver import stream_live
from encdec_engine.speech.offline import TranscriptionUpdate, stream_transcriptions
from encdec_engine.speech.options import TranscribeOptions
from encdec_engine.speech.results import Segment, Transcription
from encdec_engine.translation.conventions import task_settings
from encdec_engine.translation.tasks import Translator, summarization_prefix
from encdec_engine.checkpoints.generation_config import generation_sampling_params


class LLM:
    """Load a checkpoint once, then run batches of requests through the engine.

    >>> llm = LLM(model="path/to/bart")
    >>> outs = llm.generate(["A long document ..."], SamplingParams(temperature=0.0, max_tokens=64))
    >>> outs[0].outputs[0].text

    `model` is a checkpoint folder, a short Whisper name found offline (`tiny.en`, `base`, ...,
    `turbo`: see checkpoints/names.py) or a hub id; the default is tiny.en, bundled. `kwargs` are
    EngineConfig fields, e.g. `threads=N` (torch's CPU threads; default: the cores this process may use).
    """

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._request_ids = itertools.count()
        self._busy: str | None = None  # what holds the engine: one run steps it at a time
        self._translator: Translator | None = None  # made at the first translate

    @contextmanager
    def _exclusive(self, what: str):
        # A paused transcription stream has requests in the engine; another run would step (and take) them.
        if self._busy is not None:
            raise RuntimeError(f"this LLM is busy with an unfinished {self._busy}; finish iterating it or close() "
                               "it first")
        self._busy = what
        try:
            yield
        finally:
            self._busy = None

    def get_tokenizer(self):
        """The checkpoint's transformers tokenizer (None with skip_tokenizer_init). For a Whisper
        tokenizer the engine reads without transformers, this loads transformers' at the first call."""
        tokenizer = self.engine.tokenizer
        return tokenizer.transformers_tokenizer() if isinstance(tokenizer, WhisperTextTokenizer) else tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        All prompts are validated before any runs: a bad one raises ValueError
        naming its index, and the engine stays ready for the next call. A request
        that fails while it runs (its logits processor raised, the step running it
        failed) comes back with finish_reason "error" and `error` set; the others
        still finish.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        with self._exclusive("generate"):
            return self._run(prompts, params, use_tqdm)

    def _run(self, prompts: list, params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        ids = [f"{next(self._request_ids)}" for _ in prompts]
        added: list[str] = []
        try:
            for i, (rid, prompt, p) in enumerate(zip(ids, prompts, params)):
                try:
                    engine.add_request(rid, prompt, p)
                except ValueError as e:
                    raise ValueError(f"prompt {i}: {e}") from e
                added.append(rid)
        except ValueError:
            for rid in added:
                engine.abort_request(rid)
            raise
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id not in finished:
                        finished[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in finished:
                    engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [finished[rid] for rid in ids]

    def transcribe(self, audio, language: str | None = None, task: str = "transcribe", use_tqdm: bool = False,
                   max_in_flight: int | None = None, **options) -> list[Transcription]:
        """Transcribe audio files (any format librosa reads), arrays at 16 kHz, or (samples, sample_rate)
        pairs. Returns one Transcription per input in input order; an input that cannot be read gets
        `error` set while the others are still transcribed. `options` are TranscribeOptions fields."""
        done = self.transcribe_iter(audio, language, task, use_tqdm, max_in_flight, **options)
        return sorted(done, key=lambda t: t.index)

    def transcribe_iter(self, audio, language: str | None = None, task: str = "transcribe", use_tqdm: bool = False,
                        max_in_flight: int | None = None, **options) -> Iterator[Transcription]:
        """As `transcribe`, but yields each input's Transcription as soon as it is done: in completion
        order, not input order (`Transcription.index` is the input's position). Lazy: the engine runs
        only while you iterate; leaving the loop early aborts the rest and frees its KV blocks."""
        for update in self._updates(audio, TranscribeOptions(language=language, task=task, **options), use_tqdm,
                                    max_in_flight, "transcribe_iter"):
            if update.transcription is not None:
                yield update.transcription

    def transcribe_segments(self, audio, language: str | None = None, task: str = "transcribe",
                            **options) -> SegmentStream:
        """One input's segments as they are decoded (faster-whisper's lazy `segments` generator): each
        window is decoded when iteration reaches it, its segments yielded in time order. The stream's
        `language` and `duration` are set once known (before the first segment), `transcription` at the
        end. An input that cannot be read raises ValueError when iteration starts."""
        inputs = audio_inputs(audio)
        if len(inputs) != 1:
            raise ValueError(f"transcribe_segments takes one input, got {len(inputs)}; transcribe_iter takes several")
        options = TranscribeOptions(language=language, task=task, **options)
        return SegmentStream(self._updates(inputs, options, False, None, "transcribe_segments stream"))

    def _updates(self, audio, options: TranscribeOptions, use_tqdm: bool, max_in_flight: int | None,
                 what: str) -> Iterator[TranscriptionUpdate]:
        with self._exclusive(what):
            yield from stream_transcriptions(self.engine, options, audio, use_tqdm=use_tqdm,
                                             max_in_flight=max_in_flight)

    def transcribe_live(self, chunks, sample_rate: int = 16000, language: str | None = None,
                        **options) -> Iterator[LiveEvent]:
        """Transcribe live audio as it comes: `chunks` is an iterable of mono audio chunks (PCM16 bytes, int16
        arrays, or float arrays in [-1, 1]) at `sample_rate`, e.g. from a microphone; it may block until
        audio arrives. Yields events as they happen (speech/live/events.py): `SpeechStarted`,
        `TranscriptDelta` (confirmed text, never taken back, while the turn is spoken), `SpeechStopped`,
        `Committed`, `TranscriptCompleted` (a turn's final text). `options` are LiveOptions fields, e.g.
        `turn_detection=None` (one turn, ended when the chunks end) or `turn_detection={"silence_duration_ms":
        800}`. Lazy: the engine runs only while you iterate; leaving the loop early aborts the decode in flight."""
        session = LiveSession(LiveModel(self.engine), LiveOptions(language=language, **options))
        return self._live(session, chunks, AudioChunks(sample_rate))  # bad options raised above, not at iteration

    def _live(self, session: LiveSession, chunks, convert: AudioChunks) -> Iterator[LiveEvent]:
        with self._exclusive("transcribe_live stream"):
            yield from stream_live(self.engine, session, chunks, convert)

    def summarize(self, texts: str | Sequence[str], use_tqdm: bool = False, **overrides) -> list[str]:
        """Summaries exactly as HF `generate` makes them with the checkpoint's generation config
        (beam search, length penalty, max/min length, no-repeat n-grams, forced BOS/EOS);
        `overrides` replace SamplingParams fields."""
        if isinstance(texts, str):
            texts = [texts]
        model_type = getattr(self.engine.hf_config, "model_type", None)
        if model_type == "whisper" or not self.engine.input_processor.is_encoder_decoder:
            raise ValueError(f"{model_type} models do not summarize text; summarize serves the encoder/decoder "
                             "text models (BART, mBART, Marian, M2M100, T5, mT5); use generate with your own prompts")
        params = summarization_params(self.engine, **overrides)
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("summarize needs a tokenizer (skip_tokenizer_init=True was set)")
        limit = self.engine.input_processor.max_encoder_len
        start = [self.engine.input_processor.decoder_start_token_id]
        prefix = summarization_prefix(self.engine.hf_config)  # T5: "summarize: "
        encoded = [tok(prefix + t, truncation=True, max_length=limit)["input_ids"] for t in texts]
        prompts = [{"encoder_prompt": {"prompt_token_ids": ids}, "decoder_prompt": {"prompt_token_ids": start}}
                   for ids in encoded]
        for i, t in enumerate(texts):
            if not t.strip():
                raise ValueError(f"text {i} is empty")
        outs = self.generate(prompts, params, use_tqdm=use_tqdm)
        failed = [f"text {i}: {o.error}" for i, o in enumerate(outs) if o.error is not None]
        if failed:
            raise RuntimeError(f"summarizing failed for {'; '.join(failed)}")
        return [o.outputs[0].text.strip() for o in outs]


    def translate(self, texts: str | Sequence[str], source_language: str | None = None,
                  target_language: str | None = None, use_tqdm: bool = False, **overrides) -> list[str]:
        """Translations as HF `generate` makes them with the checkpoint's generation config, the languages
        told the model its family's way (translation/conventions.py): T5's task prefix, Marian's >>xx<<
        target token, mBART-50's, NLLB's and M2M100's source code and forced target code. Languages are
        ISO 639-1 or 639-3 codes, English names, or the model's own codes (de_DE, deu_Latn); the source
        defaults to English where the model needs one. `overrides` replace SamplingParams fields. A text
        longer than the encoder's limit is a ValueError naming it."""
        if isinstance(texts, str):
            texts = [texts]
        if self._translator is None:
            self._translator = Translator(self.engine)
        translator = self._translator
        request = translator.request(source_language, target_language)
        prompts = []
        limit = self.engine.input_processor.max_encoder_len
        for i, text in enumerate(texts):
            try:
                prompt = translator.prompt(request, text)
                length = len(prompt["encoder_prompt"]["prompt_token_ids"])
                if limit is not None and length > limit:
                    raise ValueError(f"{length} tokens with the language codes or prefix; this model's encoder "
                                     f"takes at most {limit}: shorten it or split it")
            except ValueError as e:
                raise ValueError(f"text {i}: {e}") from None
            prompts.append(prompt)
        outs = self.generate(prompts, translator.params(request, **overrides), use_tqdm=use_tqdm)
        failed = [f"text {i}: {o.error}" for i, o in enumerate(outs) if o.error is not None]
        if failed:
            raise RuntimeError(f"translating failed for {'; '.join(failed)}")
        return [translator.text(request, o.outputs[0].token_ids) for o in outs]


class SegmentStream:
    """An iterator of one input's Segments, decoded as it is iterated (see `LLM.transcribe_segments`)."""

    def __init__(self, updates: Iterator[TranscriptionUpdate]) -> None:
        self._updates = updates
        self._ready: list[Segment] = []
        self.language: str | None = None  # known with the first segment (detected, or as asked)
        self.duration: float | None = None  # seconds of audio
        self.transcription: Transcription | None = None  # the whole result, once iteration has ended

    def __iter__(self) -> SegmentStream:
        return self

    def __next__(self) -> Segment:
        while not self._ready:
            update = next(self._updates)  # StopIteration ends the stream
            done = update.transcription
            if done is not None:
                if done.error is not None:
                    raise ValueError(done.error)
                self.transcription, self.language, self.duration = done, done.language, done.duration
            self._ready = list(update.segments)
            if self._ready and self.language is None:
                self.language, self.duration = update.language, update.duration
        return self._ready.pop(0)

    def close(self) -> None:
        """Stop decoding: the requests in flight are aborted and the engine is free for other calls."""
        self._updates.close()


def summarization_params(engine: LLMEngine, **overrides) -> SamplingParams:
    """The checkpoint's HF generation config (with config.json's task_specific_params["summarization"], as
    HF's summarization pipeline applies them) as SamplingParams; `overrides` replace fields."""
    settings = task_settings(engine.hf_config, "summarization")
    settings.pop("prefix", None)
    return generation_sampling_params(engine.generation_config, settings, **overrides)
