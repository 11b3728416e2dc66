"""`encdec transcribe --live SOURCE`: live transcription on the command line, confirmed text printed as it
comes and each turn ended with a newline (`--verbose`: each turn's final text with its times instead).

    encdec transcribe --live -             raw 16-bit mono PCM from stdin (--live-rate Hz; a microphone:
                                           ffmpeg -f alsa -i default -f s16le -ac 1 -ar 16000 - | encdec transcribe --live -)
    encdec transcribe --live talk.wav      a file played at real-time pace (--live-speed 0: as fast as read)
    ... --server http://host:8000          no model here: the stream goes to a running `encdec serve`'s
                                           /v1/realtime (OpenAI's Realtime protocol, the websockets client)
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import threading
import time
from collections.abc import Iterator

from encdec_engine.cli.args import api_key, check_engine_args, error, load_llm
from encdec_engine.speech.live.events import LiveEvent, TranscriptCompleted, TranscriptDelta, TranscriptFailed
from encdec_engine.speech.live.options import LiveOptions, TurnDetection

CHUNK_SECONDS = 0.1  # what is read (stdin) or played (a file) at a time
FINISH_TIMEOUT = 120.0  # s a server may take for the last turns once the stream has ended


def live_options(args: argparse.Namespace) -> LiveOptions:
    """The live flags as LiveOptions (the --vad-* flags are server_vad's parameters here)."""
    turn = None
    if args.turn_detection == "server_vad":
        given = {"threshold": args.vad_threshold, "silence_duration_ms": args.vad_min_silence_duration_ms,
                 "prefix_padding_ms": args.vad_speech_pad_ms}
        turn = TurnDetection(**{k: v for k, v in given.items() if v is not None})
    return LiveOptions(language=args.language, task=args.task, prompt=args.initial_prompt, turn_detection=turn)


def check_live_args(args: argparse.Namespace) -> LiveOptions:
    """Every check that needs no model: ValueError naming the flag."""
    if args.live is None:
        raise ValueError("--server sends a live stream: give --live - (stdin) or --live FILE")
    if args.audio:
        raise ValueError(f"--live transcribes one stream; leave out the audio files ({', '.join(args.audio)})")
    if args.live_speed < 0:
        raise ValueError(f"--live-speed must be 0 (as fast as read) or more, got {args.live_speed}")
    if not 8000 <= args.live_rate <= 192000:
        raise ValueError(f"--live-rate must be a sample rate in Hz (8000 to 192000), got {args.live_rate}")
    if args.live != "-" and not os.path.isfile(args.live):
        raise ValueError(f"--live {args.live}: no such file")
    if args.verbose and args.quiet:
        raise ValueError("--verbose prints turns and --quiet prints nothing: give one of them")
    return live_options(args)


def cmd_live(args: argparse.Namespace) -> int:
    options = check_live_args(args)
    chunks, rate = _source(args)
    printer = _Printer(verbose=args.verbose, quiet=args.quiet)
    try:
        if args.server is not None:
            return _via_server(args, options, chunks, rate, printer)
        check_engine_args(args)
        llm = load_llm(args)
        for event in llm.transcribe_live(chunks, rate, language=options.language, task=options.task,
                                         prompt=options.prompt, turn_detection=options.turn_detection):
            printer.live(event)
    except KeyboardInterrupt:
        printer.end()
        return 130
    printer.end()
    return 0


def _source(args: argparse.Namespace) -> tuple[Iterator[bytes], int]:
    """100 ms chunks of 16-bit PCM bytes, and their rate."""
    if args.live == "-":
        size = 2 * round(args.live_rate * CHUNK_SECONDS)
        return iter(lambda: sys.stdin.buffer.read(size), b""), args.live_rate
    from encdec_engine.inputs.audio import SAMPLE_RATE, load_audio  # lazy: numpy and libsndfile (0.1 s)

    pcm = (load_audio(args.live).clip(-1, 1) * 32767).astype("<i2").tobytes()
    size = 2 * round(SAMPLE_RATE * CHUNK_SECONDS)

    def played() -> Iterator[bytes]:
        start = time.monotonic()
        for k, i in enumerate(range(0, len(pcm), size)):
            if args.live_speed:  # chunk k is due once its audio has been "spoken"
                time.sleep(max(0.0, start + k * CHUNK_SECONDS / args.live_speed - time.monotonic()))
            yield pcm[i : i + size]

    return played(), SAMPLE_RATE


class _Printer:
    """Deltas as they come, a newline when a turn completes (--verbose: the turn's final text and times)."""

    def __init__(self, verbose: bool, quiet: bool) -> None:
        self.verbose, self.quiet, self.open = verbose, quiet, False

    def live(self, e: LiveEvent) -> None:
        if self.quiet:
            return
        if isinstance(e, TranscriptDelta) and not self.verbose:
            self._write(e.delta)
            self.open = True
        elif isinstance(e, TranscriptCompleted):
            if self.verbose:
                self._write(f"[{_clock(e.audio_start_ms)} --> {_clock(e.audio_end_ms)}] {e.transcript}\n")
            elif self.open:
                self._write("\n")
            self.open = False
        elif isinstance(e, TranscriptFailed):
            self.end()
            error(f"a turn could not be transcribed: {e.message}")

    def end(self) -> None:
        if self.open:
            self._write("\n")
            self.open = False

    @staticmethod
    def _write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()


def _clock(ms: int) -> str:
    minutes, ms = divmod(ms, 60_000)
    return f"{minutes:02d}:{ms // 1000:02d}.{ms % 1000:03d}"


# -- client mode -----------------------------------------------------------------------------
def _via_server(args: argparse.Namespace, options: LiveOptions, chunks: Iterator[bytes], rate: int,
                printer: _Printer) -> int:
    """Stream to a server's /v1/realtime; prints its events as they come. Returns once every turn the
    server committed has its final text (the stream's end is committed by hand)."""
    import websockets.sync.client  # lazy: only client mode talks to a server

    from encdec_engine.inputs.pcm_stream import AudioChunks  # lazy: numpy and soxr (0.1 s)

    resample = None if rate in (16000, 24000) else AudioChunks(rate)  # the server takes 16 or 24 kHz pcm16
    key = api_key(args.api_key, "ENCDEC_API_KEY", "OPENAI_API_KEY")
    url = args.server.rstrip("/").replace("https://", "wss://").replace("http://", "ws://")
    url = (url if url.endswith("/v1") else url + "/v1") + "/realtime?intent=transcription"
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    td = options.turn_detection
    session = {"type": "transcription", "audio": {"input": {
        "format": {"type": "audio/pcm", "rate": 16000 if resample else rate},
        "transcription": {"language": options.language, "prompt": options.prompt},
        "turn_detection": None if td is None else {"type": "server_vad", "threshold": td.threshold,
                                                   "prefix_padding_ms": td.prefix_padding_ms,
                                                   "silence_duration_ms": td.silence_duration_ms}}}}
    try:
        ws = websockets.sync.client.connect(url, additional_headers=headers, max_size=None)
    except (OSError, websockets.exceptions.InvalidHandshake) as e:
        raise ValueError(f"--server {args.server}: cannot open {url}: {e}") from None
    with ws:
        events = _ServerEvents(ws, printer)
        ws.send(json.dumps({"type": "session.update", "session": session}))
        for chunk in chunks:
            if events.failed:
                break
            if resample is not None:
                chunk = (resample(chunk).clip(-1, 1) * 32767).astype("<i2").tobytes()
            ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()}))
        if not events.failed:
            events.final_sent = True
            ws.send(json.dumps({"type": "input_audio_buffer.commit", "event_id": "final_commit"}))
        finished = events.wait(FINISH_TIMEOUT)
    printer.end()
    if events.failed:
        error(events.failed)
        return 1
    if not finished:
        error(f"the server did not finish the last turns within {FINISH_TIMEOUT:g} s")
        return 1
    return 0


class _ServerEvents:
    """Reads the server's events in a thread: prints them, and knows when every committed turn is done."""

    def __init__(self, ws, printer: _Printer) -> None:
        self.ws, self.printer = ws, printer
        self.pending: dict[str, tuple[int, int]] = {}  # committed turns without their final text: (start, end) ms
        self.spans: dict[str, tuple[int, int]] = {}  # turns detected by the server's VAD
        self.failed: str | None = None
        self.final_sent = False  # the stream's end was committed by hand
        self.final_answered = False  # ... and the server answered it (committed, or nothing was left to commit)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for message in self.ws:
                self._take(json.loads(message))
        except Exception as e:  # the connection broke
            self.failed = self.failed or f"the server connection ended: {e}"
        finally:
            self.done.set()

    def _take(self, e: dict) -> None:
        kind = e.get("type", "")
        item = e.get("item_id")
        if kind == "error":
            err = e.get("error") or {}
            if err.get("event_id") == "final_commit":  # nothing was open to commit at the end
                self.final_answered = True
            else:
                self.failed = f"the server refused: {err.get('message')}"
                self.done.set()
        elif kind == "input_audio_buffer.speech_started":
            self.spans[item] = (e["audio_start_ms"], e["audio_start_ms"])
        elif kind == "input_audio_buffer.speech_stopped":
            self.spans[item] = (self.spans.get(item, (0, 0))[0], e["audio_end_ms"])
        elif kind == "input_audio_buffer.committed":
            by_hand = self.spans.get(item, (0, 0))[1] == self.spans.get(item, (0, 0))[0]  # no speech_stopped
            self.pending[item] = self.spans.get(item, (0, 0))
            self.final_answered = self.final_answered or (self.final_sent and by_hand)
        elif kind == "conversation.item.input_audio_transcription.delta":
            self.printer.live(TranscriptDelta(item, e["delta"], 0))
        elif kind == "conversation.item.input_audio_transcription.completed":
            start, end = self.pending.pop(item, (0, 0))
            end = max(end, start + round(1000 * e.get("usage", {}).get("seconds", 0)))
            self.printer.live(TranscriptCompleted(item, e["transcript"], start, end))
        elif kind == "conversation.item.input_audio_transcription.failed":
            self.printer.live(TranscriptFailed(item, e["error"]["message"]))
        if self.final_answered and not self.pending:
            self.done.set()

    def wait(self, timeout: float) -> bool:
        return self.done.wait(timeout) and not self.failed
