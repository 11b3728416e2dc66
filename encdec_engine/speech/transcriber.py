"""One input's transcription as a series of engine requests, for any driver.

Audio up to 30 s is one window, decoded exactly as HF `generate` does (features of the zero-padded
30 s window). Longer audio follows openai-whisper: sequential 30 s windows that seek to the last
timestamp token, each conditioned on the text kept so far, with temperature fallback when the
compression ratio or the mean log-probability says a window failed, and silent windows skipped.

A driver (`offline.transcribe_offline` over `LLMEngine.step`, `async_driver.transcribe_async` over
`AsyncLLMEngine`) runs the protocol below; the windows of all the jobs in flight share the
engine's batches.

    job = load(index, audio)
    ready = start(job)                      # the jobs that need a request now
    for each ready job, until none is:
        prompt, params = next_request(job)  # -> the engine
        ready = take(job, finished output)  # [] when the job is done
    result(job)                             # -> Transcription

"Detect the language once, then fan the chunks out" is decided here, in `_ready`, and nowhere else:
a multilingual checkpoint's job first decodes one language-detection request; once its language
is known, a chunked input splits into its chunk jobs, which then run at once.
"""

from __future__ import annotations

from encdec_engine.checkpoints.whisper_tokens import WhisperTokens, language_code
from encdec_engine.outputs import RequestOutput
from encdec_engine.sampling_params import SamplingParams
from encdec_engine.speech.assembly import ResultAssembler
from encdec_engine.speech.fallback import Verdict
from encdec_engine.speech.job import DecodedWindow, TranscriptionJob
from encdec_engine.speech.options import TranscribeOptions
from encdec_engine.speech.ranking import best_candidate
from encdec_engine.speech.requests import WindowRequests
from encdec_engine.speech.results import Transcription
from encdec_engine.speech.windows import WindowPlanner


class Transcriber:
    """Moves jobs from one request to the next with its three pieces: the window planner, the
    request builder and the result assembler. Holds no job state itself."""

    def __init__(self, engine, options: TranscribeOptions) -> None:
        if getattr(engine.model, "num_mel_bins", None) is None:
            raise ValueError("transcribe needs a Whisper checkpoint")
        self.options = options
        self.tokens = WhisperTokens.from_configs(engine.hf_config, engine.generation_config)
        self.planner = WindowPlanner(options, engine.model.num_mel_bins)
        self.requests = WindowRequests(engine, options, self.tokens)
        self.assembler = ResultAssembler(options, self.tokens, engine.tokenizer)
        # "English" -> "en"; None: detected per input, except on English-only checkpoints.
        self.language = "en" if not self.tokens.is_multilingual else None
        if options.language is not None:
            self.language = language_code(options.language)

    def load(self, index: int, item) -> TranscriptionJob:
        """Read one input (path, bytes, array, or (samples, rate)); a bad one gets `error` set."""
        return self.planner.load(index, item, self.language)

    def load_many(self, pairs: list[tuple[int, object]]) -> list[TranscriptionJob]:
        """Read (index, input) pairs at once: the VAD, when asked for, runs on all of them together."""
        return self.planner.load_many(pairs, self.language)

    def start(self, job: TranscriptionJob) -> list[TranscriptionJob]:
        """The jobs of a loaded input that need a request first (none for a bad input, or one whose
        clips hold no audio)."""
        return [] if job.error is not None or job.done else self._ready(job)

    def next_request(self, job: TranscriptionJob) -> tuple[dict, SamplingParams]:
        """The engine request (prompt, params) for the job's current window."""
        return self.requests.build(job, self.planner.window_features(job))

    def take(self, job: TranscriptionJob, out: RequestOutput) -> list[TranscriptionJob]:
        """Fold the job's finished request in. Returns the jobs that need a request next: the job
        itself, none once it is done, or, after the language is detected, the input's chunks."""
        if out.error is not None:  # the request failed in the engine: its tokens are no window's decode
            raise RuntimeError(f"transcribing input {job.index} failed: {out.error}")
        if job.language is None:  # that was language detection
            job.language = self.tokens.language_of(out.outputs[0].token_ids[0]) or "en"
            return self._ready(job)
        return [job] if self._take_window(job, out) else []

    def result(self, job: TranscriptionJob) -> Transcription:
        """The transcript of a loaded input once none of its jobs needs a request."""
        return self.assembler.result(job)

    def _ready(self, job: TranscriptionJob) -> list[TranscriptionJob]:
        # The language is detected once per input, on its first window; then its chunks fan out.
        return [job] if job.language is None else self.planner.split(job)

    def _take_window(self, job: TranscriptionJob, out: RequestOutput) -> bool:
        """Take a decode or alignment request's output; True if the job needs another request."""
        if job.pending is not None:  # the words of a decoded window
            window, job.pending = job.pending, None
            window = self.assembler.align(job, window, out, len(self.requests.alignment_prefix(job)))
            if window is None:  # dropped as a hallucination; `seek` is past it
                return self.planner.advance(job)
            self._commit(job, window)
            return self.planner.next_window(job)
        temperature = self.options.temperatures[job.temperature_index]
        forced = self.requests.prompts.forced(job)
        chosen = best_candidate(out, self.tokens.eot, self.options.length_penalty)
        quality = self.assembler.quality(chosen, forced, out.probes.no_speech_prob)  # every decode asks for it
        verdict = self.requests.fallback(job, quality)
        if verdict is Verdict.RETRY:
            return True
        if verdict is Verdict.SKIP:  # no segment, nothing conditions the next window
            return self.planner.skip_window(job)
        window = self.assembler.decoded_window(job, forced + chosen.tokens, self.planner.window_frames(job),
                                               temperature, quality)
        if self.options.aligns_words:
            if self.requests.can_align(job, window):
                job.pending = window  # the next request aligns its words
                return True
            for seg in window.segments:
                seg.words = []
        self._commit(job, window)
        return self.planner.next_window(job)

    def _commit(self, job: TranscriptionJob, window: DecodedWindow) -> None:
        self.assembler.commit(job, window)
        self.requests.prompts.after_window(job, window.temperature)
