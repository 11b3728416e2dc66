"""One live stream: its audio as it arrives, turn detection, its turns in order, and the engine request a
driver should send next. Engine-independent: a driver (live/sync_driver.py over `LLMEngine`, live/async_driver.py over
`AsyncLLMEngine`) sends `next_request()` to the engine and hands the result back to `take()`; at most one
request of a session is in flight, so its turns complete in the order they were committed.

    append(audio) --VAD--> turn opens (speech_started) ... audio ... turn ends (speech_stopped, committed)
                                |  partial decodes: deltas        |  final decode: last delta, completed
    open turn: at most one      ending turns: a queue, each waiting for its final text (oldest first)

Without turn detection a turn opens with the first audio after a commit and ends at the next `commit()`.
"""

from __future__ import annotations

import itertools
from collections import deque

import numpy as np

from encdec_engine.inputs.audio import SAMPLE_RATE
from encdec_engine.outputs import RequestOutput
from encdec_engine.speech.live.events import (Cleared, Committed, LiveEvent, SpeechStarted, SpeechStopped,
                                              TranscriptCompleted, TranscriptDelta, TranscriptFailed)
from encdec_engine.speech.live.model import LiveModel
from encdec_engine.speech.live.options import LiveOptions
from encdec_engine.speech.live.turn import Kind, LiveRequest, LiveTurn
from encdec_engine.speech.live.vad import FRAME_SAMPLES, Mark, TurnDetector

MIN_COMMIT_SAMPLES = SAMPLE_RATE // 10  # OpenAI refuses to commit less than 100 ms of audio


class LiveError(ValueError):
    """Something asked of a session that cannot be done now; `code` names it (OpenAI's error code)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def ms(samples: int) -> int:
    return samples * 1000 // SAMPLE_RATE


class LiveSession:
    """The state of one stream (see the module docstring)."""

    def __init__(self, model: LiveModel, options: LiveOptions, id_prefix: str = "item_") -> None:
        self.model = model
        self.received = 0  # samples appended since the stream began
        self.ring = np.zeros(0, dtype=np.float32)  # the latest audio outside any turn (for the prefix padding)
        self.open: LiveTurn | None = None
        self.ending: deque[LiveTurn] = deque()  # ended turns waiting for their final text, oldest first
        self.in_flight: LiveRequest | None = None
        self.last_item: str | None = None  # the last turn committed
        self.announced: set[str] = set()  # open turns whose speech_started was sent (voice detection opened them)
        self.spoken: list[int] = []  # the latest tokens of the turns done (they condition later ones if asked)
        self._ids = (f"{id_prefix}{n:04d}" for n in itertools.count(1))
        self.configure(options)

    def configure(self, options: LiveOptions) -> None:
        """New options: the prompt, language and policy apply to turns that open from now on; turn
        detection changes at once (a turn already open stays open until the new rule ends it)."""
        self.prompt = self.model.prompt_tokens(options.prompt)  # ValueError for special-token text
        old = getattr(self, "options", None)
        self.options = options
        if old is None or old.turn_detection != options.turn_detection:
            detection = options.turn_detection
            self.detector = TurnDetector(detection, self.received, self.open is not None) if detection else None

    # -- audio and turns ---------------------------------------------------------------------
    def append(self, samples: np.ndarray, probs: np.ndarray | None = None) -> list[LiveEvent]:
        """Take [num_samples] float32 16 kHz audio; returns the turn boundaries it completes. `probs`: the
        speech probabilities of the frames it completes, where the caller had `self.detector.vad` find them
        (with other streams': `push_streams`); by default voice detection runs here."""
        start = self.received
        self.received += len(samples)
        if self.detector is None:
            if self.open is None and len(samples):
                self.open = self._new_turn(start)
            self._route(samples)
            return []
        events: list[LiveEvent] = []
        position = start
        for mark in self.detector.push(samples) if probs is None else self.detector.take(probs):
            self._route(samples[position - start : mark.at - start])
            position = mark.at
            events += self._speech_started(mark) if mark.kind == "start" else self._speech_stopped(mark)
        self._route(samples[position - start :])
        return events

    def commit(self) -> list[LiveEvent]:
        """End the open turn now (OpenAI's input_audio_buffer.commit); LiveError if it holds under 100 ms."""
        turn = self.open
        if turn is None or turn.num_samples < MIN_COMMIT_SAMPLES:
            held = 0 if turn is None else turn.num_samples
            raise LiveError("input_audio_buffer_commit_empty", f"buffer too small: expected at least 100 ms of "
                            f"audio, the buffer holds {ms(held)} ms")
        events = self._end(turn)
        if self.detector is not None and self.detector.speaking:  # still speaking: what follows is a new turn
            events += self._open_at(self.received)
        return events

    def clear(self) -> list[LiveEvent]:
        """Drop the audio not committed (the open turn; its deltas stay sent)."""
        if self.open is not None:
            self.announced.discard(self.open.item_id)
        self.open, self.ring = None, self.ring[:0]
        return [Cleared()]

    def finish(self) -> list[LiveEvent]:
        """The stream has ended: the open turn ends where the audio does (a turn under 100 ms is dropped)."""
        turn = self.open
        if turn is None or turn.num_samples < MIN_COMMIT_SAMPLES:
            if turn is not None:
                self.announced.discard(turn.item_id)
            self.open = None
            return []
        stopped = [SpeechStopped(turn.item_id, ms(self.received))] if turn.item_id in self.announced else []
        return stopped + self._end(turn)

    def _new_turn(self, start: int) -> LiveTurn:
        language = self.options.language or (None if self.model.tokens.is_multilingual else "en")
        context = self.prompt + (self.spoken if self.options.condition_on_previous_turns else [])
        return LiveTurn(self.model, self.options, next(self._ids), start, context[-self.model.half :], language)

    def _route(self, samples: np.ndarray) -> None:
        if self.open is not None:
            self.open.append(samples)
        elif self.detector is not None:
            keep = self.options.turn_detection.prefix_padding_ms * SAMPLE_RATE // 1000 + FRAME_SAMPLES
            self.ring = np.concatenate([self.ring, samples])[-keep:] if keep else self.ring[:0]

    def _speech_started(self, mark: Mark) -> list[LiveEvent]:
        if self.open is not None:  # a turn committed by hand while speaking is already open
            return []
        boundary = max(mark.boundary, mark.at - len(self.ring))
        return self._open_at(boundary, self.ring[len(self.ring) - (mark.at - boundary) :])

    def _open_at(self, boundary: int, prefix: np.ndarray | None = None) -> list[LiveEvent]:
        self.open, self.ring = self._new_turn(boundary), self.ring[:0]
        if prefix is not None:
            self.open.append(prefix)
        self.announced.add(self.open.item_id)
        return [SpeechStarted(self.open.item_id, ms(boundary))]

    def _speech_stopped(self, mark: Mark) -> list[LiveEvent]:
        turn = self.open
        if turn is None:  # cleared while speaking
            return []
        # A turn opened by hand before voice detection was turned on had no speech_started: none stopped either.
        stopped = [SpeechStopped(turn.item_id, ms(mark.boundary))] if turn.item_id in self.announced else []
        return stopped + self._end(turn)

    def _end(self, turn: LiveTurn) -> list[LiveEvent]:
        turn.end()
        self.announced.discard(turn.item_id)
        self.open = None
        self.ending.append(turn)
        previous, self.last_item = self.last_item, turn.item_id
        return [Committed(turn.item_id, previous)]

    # -- requests ----------------------------------------------------------------------------
    def next_request(self) -> LiveRequest | None:
        """The request to send now: an ended turn's (oldest first), else a partial decode of the open turn
        when enough new audio has come; None while one is in flight or nothing is due."""
        if self.in_flight is not None:
            return None
        turn = self.ending[0] if self.ending else self.open
        if turn is None or not turn.wants_decode():
            return None
        self.in_flight = turn.request()
        return self.in_flight

    def superseded(self, request: LiveRequest) -> bool:
        """Whether an in-flight request is no use any more: a partial decode of a turn that has ended since
        (its final decode should go instead), or of one that was cleared."""
        turn = request.turn
        alive = turn is self.open or turn in self.ending
        return not alive or (request.kind is Kind.PARTIAL and turn.ended)

    def take(self, request: LiveRequest, generated: list[int], no_speech_prob: float = 0.0,
             avg_logprob: float = 0.0) -> list[LiveEvent]:
        """Fold a finished request in: the delta it confirmed, and its turn's final text once done."""
        self._landed(request)
        turn = request.turn
        if turn is not self.open and turn not in self.ending:  # cleared meanwhile
            return []
        delta = turn.take(request, generated, no_speech_prob, avg_logprob)
        events: list[LiveEvent] = [TranscriptDelta(turn.item_id, delta, ms(request.audio_end))] if delta else []
        if turn.done:
            self.ending.popleft()
            self.spoken = (self.spoken + turn.history + turn.final_tokens)[-self.model.half :]
            end = turn.start + turn.num_samples
            events.append(TranscriptCompleted(turn.item_id, turn.text, ms(turn.start), ms(end)))
        return events

    def take_output(self, request: LiveRequest, out: RequestOutput) -> list[LiveEvent]:
        """`take` (or `fail`) a finished engine output of the request."""
        if out.error is not None:
            return self.fail(request, out.error)
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        eot = self.model.tokens.eot
        length = tokens.index(eot) if eot in tokens else len(tokens)
        avg_logprob = (completion.cumulative_logprob or 0.0) / (length + 1)  # openai-whisper's mean
        return self.take(request, tokens, out.no_speech_prob or 0.0, avg_logprob)

    def fail(self, request: LiveRequest, message: str) -> list[LiveEvent]:
        """The request failed in the engine: an ended turn fails (its text so far is not its transcript);
        an open turn's partial decode is simply tried again with more audio."""
        self._landed(request)
        turn = request.turn
        if turn in self.ending:
            self.ending.remove(turn)
            return [TranscriptFailed(turn.item_id, message)]
        turn.decoded = max(turn.decoded, request.covers)  # tried again once more audio has come
        return []

    def drop(self, request: LiveRequest) -> None:
        """The request was aborted (superseded, or the stream closed): nothing of it is taken."""
        self._landed(request)

    def _landed(self, request: LiveRequest) -> None:
        if self.in_flight is request:
            self.in_flight = None

    # -- state ----------------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        """Nothing to decode now or later: no turn open or waiting, no request in flight."""
        return self.open is None and not self.ending and self.in_flight is None

    @property
    def buffered_seconds(self) -> float:
        """Audio held in turn buffers (what the per-session bound limits)."""
        turns = [*self.ending, *([self.open] if self.open is not None else [])]
        return sum(len(t.audio) for t in turns) / SAMPLE_RATE

    @property
    def backlog_seconds(self) -> float:
        """Audio of the turns that no decode has covered yet (grows when the engine falls behind)."""
        turns = [*self.ending, *([self.open] if self.open is not None else [])]
        return sum(t.pending for t in turns) / SAMPLE_RATE
