"""Live transcription benchmark: N simulated clients, each streaming a different recording at real-time pace
over /v1/realtime (OpenAI's Realtime protocol, 100 ms chunks of pcm16 at 24 kHz, server_vad), for N = 1, 2,
4, 8, 16, ... Beside it, in the same run, the same streaming policy (speech/live/session.py: the same VAD,
turns, LocalAgreement and final decode) driven through faster-whisper one stream at a time, the way
whisper_streaming runs, to show what batching every stream's re-decodes into one engine buys.

Per N it prints:
- word lag: for each confirmed word (deltas), the wall time it arrived minus the time its audio was spoken
  (the word's end in the recording, from offline word timestamps of each clip), p50 / p95 / max;
- completed: the wall time of each turn's .completed minus the moment its audio ended (the chunk that
  completed the silence ending the turn was sent), p50 / p95 / max;
- WER of each turn's completed text against the offline transcription of the same samples (the engine:
  /v1/audio/transcriptions of the span; faster-whisper: its own transcribe of the span);
- the CPU the server (or the faster-whisper process) used, in cores, and the server's event loop thread
  alone (voice detection, audio conversion, events); the share of the time its engine thread was in a
  step (`encdec_engine_busy_seconds_total`; the rest it waited for work);
- whether it stayed real time: p95 word lag <= 2.0 s and p95 completed <= 1.0 s (the issue's targets).
Then the largest N that stayed real time, for each.

The server runs without its prefix cache: stream i sends the same recording at every N (and again when an N
repeats), so its turns' final decodes would find the encoder output of an earlier round in the cache; until
2026-11-29 they did, and figures from before then are better than the engine's.

    python scripts/bench_realtime.py                          # N = 1, 2, 4, 8, 12, 16, 24, 32 (stops past real time)
    python scripts/bench_realtime.py --quantization int8      # the engine and faster-whisper on int8 weights
    python scripts/bench_realtime.py --quick                  # N = 1, 2 on short recordings: a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import difflib
import io
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import soundfile as sf
import websockets.asyncio.client
from load_test import stop, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
AUDIO = ROOT / "prompts" / "audio"
CLIPS = ["fox.wav", "weather.wav", "stella.wav", "learning.wav", "thanks_fast.wav", "coffee.wav",
         "meeting_stereo_44k.wav"]
KEY = "bench"
CHUNK = 0.1  # s per append
LAG_TARGET, COMPLETED_TARGET = 2.0, 1.0  # s: p95 word lag, p95 .completed after the turn's audio ended

from encdec_engine.inputs.audio import SAMPLE_RATE, load_audio, resample  # noqa: E402
from encdec_engine.inputs.pcm_stream import AudioChunks  # noqa: E402


@dataclass
class Recording:
    """One client's audio: clips with gaps, as sent (pcm16 at 24 kHz) and as the server hears it (16 kHz)."""

    clips: list[tuple[str, float]]  # (clip, its start in seconds)
    pcm: bytes
    heard: np.ndarray
    chunks: list[bytes] = field(default_factory=list)


@dataclass
class Run:
    lags: list[float] = field(default_factory=list)
    completed: list[float] = field(default_factory=list)
    turns: list[tuple[str, np.ndarray]] = field(default_factory=list)  # (final text, the turn's samples)
    deltas: list[str] = field(default_factory=list)  # each turn's deltas joined, as the client shows them
    early: int = 0  # turns with text before their speech stopped
    cpu: float = 0.0
    loop_cpu: float | None = None  # the server's event loop thread alone (voice detection, events), in cores
    busy: float | None = None  # the share of the wall time the server's engine thread spent in steps
    wer: float = float("nan")
    unmatched: int = 0


def recordings(n: int, quick: bool) -> list[Recording]:
    out = []
    for i in range(n):
        rng = random.Random(i)
        order = CLIPS[i % len(CLIPS):] + CLIPS[: i % len(CLIPS)]
        order = order[:2] if quick else order
        parts, clips, t = [np.zeros(int(rng.uniform(0.5, 1.0) * SAMPLE_RATE), np.float32)], [], 0.0
        t = len(parts[0]) / SAMPLE_RATE
        for clip in order:
            audio = load_audio(AUDIO / clip)
            clips.append((clip, t))
            gap = np.zeros(int(rng.uniform(0.8, 1.6) * SAMPLE_RATE), np.float32)
            parts += [audio, gap]
            t += (len(audio) + len(gap)) / SAMPLE_RATE
        parts.append(np.zeros(SAMPLE_RATE, np.float32))  # the last turn ends by silence, as a speaker's would
        audio = np.concatenate(parts)
        pcm = (np.clip(resample(audio, SAMPLE_RATE, 24000), -1, 1) * 32767).astype("<i2").tobytes()
        size = int(24000 * CHUNK) * 2
        chunks = [pcm[k : k + size] for k in range(0, len(pcm), size)]
        heard = AudioChunks(24000)
        out.append(Recording(clips, pcm, np.concatenate([heard(c) for c in chunks]), chunks))
    return out


def word_times(url: str) -> dict[str, list[tuple[str, float]]]:
    """Each clip's words and their end times (offline word timestamps from the server)."""
    times = {}
    for clip in CLIPS:
        with open(AUDIO / clip, "rb") as f:
            r = httpx.post(f"{url}/v1/audio/transcriptions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                           files={"file": f}, data={"response_format": "verbose_json", "language": "en",
                                                    "timestamp_granularities[]": "word"})
        r.raise_for_status()
        times[clip] = [(_norm(w["word"]), w["end"]) for w in r.json()["words"]]
    return times


def _norm(word: str) -> str:
    return re.sub(r"\W", "", word.lower())


def lags_of(words: list[tuple[float, str]], rec: Recording, times: dict, t0: float, span: tuple[float, float]) -> tuple[list[float], int]:
    """Lags of a turn's confirmed words [(arrival, word)], matched in order to the words spoken in its span."""
    spoken = [(w, start + end) for clip, start in rec.clips for w, end in times[clip]
              if span[0] - 0.5 <= start + end <= span[1] + 0.5]
    matcher = difflib.SequenceMatcher(None, [w for _, w in words], [w for w, _ in spoken], autojunk=False)
    lags, matched = [], 0
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            arrival, _ = words[block.a + k]
            lags.append(arrival - (t0 + spoken[block.b + k][1]))
            matched += 1
    return lags, len(words) - matched


# -- the engine over the websocket ----------------------------------------------------------------
async def client(url: str, rec: Recording, times: dict, delay: float, run: Run) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    async with websockets.asyncio.client.connect(url, additional_headers=headers, max_size=None) as ws:
        await ws.recv()
        await ws.send(json.dumps({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
            "format": {"type": "audio/pcm", "rate": 24000}, "transcription": {"model": "whisper-1", "language": "en"},
            "turn_detection": {"type": "server_vad"}}}}}))
        await ws.recv()
        events: list[tuple[float, dict]] = []
        open_turns: set[str] = set()

        async def read() -> None:
            async for message in ws:
                e = json.loads(message)
                events.append((time.monotonic(), e))
                if e["type"] == "input_audio_buffer.speech_started":
                    open_turns.add(e["item_id"])
                elif e["type"].endswith("transcription.completed"):
                    open_turns.discard(e["item_id"])

        reader = asyncio.ensure_future(read())
        await asyncio.sleep(delay)
        t0 = time.monotonic()
        for k, chunk in enumerate(rec.chunks):
            await asyncio.sleep(max(0.0, t0 + (k + 1) * CHUNK - time.monotonic()))  # chunk k is spoken by then
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()}))
        deadline = time.monotonic() + 120
        while open_turns and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        reader.cancel()
    _tally(events, rec, times, t0, run)


def _tally(events: list[tuple[float, dict]], rec: Recording, times: dict, t0: float, run: Run) -> None:
    by_item: dict[str, dict] = {}
    for t, e in events:
        item = by_item.setdefault(e.get("item_id", ""), {"deltas": []})
        kind = e["type"]
        if kind == "input_audio_buffer.speech_started":
            item["start_ms"] = e["audio_start_ms"]
        elif kind == "input_audio_buffer.speech_stopped":
            item["end_ms"], item["stopped_at"] = e["audio_end_ms"], t
        elif kind.endswith("transcription.delta"):
            item["deltas"] += [(t, w) for w in map(_norm, e["delta"].split()) if w]
        elif kind.endswith("transcription.completed"):
            item["text"], item["done_at"] = e["transcript"], t
    for item in by_item.values():
        if "text" not in item or "end_ms" not in item:
            continue
        span = (item["start_ms"] / 1000, item["end_ms"] / 1000)
        lags, unmatched = lags_of(item["deltas"], rec, times, t0, span)
        run.lags += lags
        run.unmatched += unmatched
        run.completed.append(item["done_at"] - (t0 + span[1]))
        run.early += any(t < item["stopped_at"] for t, _ in item["deltas"])
        run.turns.append((item["text"], rec.heard[item["start_ms"] * 16 : item["end_ms"] * 16]))
        run.deltas.append(" ".join(w for _, w in item["deltas"]))


def engine_run(url: str, recs: list[Recording], times: dict, pid: int) -> Run:
    run = Run()
    ws_url = url.replace("http://", "ws://") + "/v1/realtime?intent=transcription"
    cpu, loop_cpu, busy, wall = _cpu_seconds(pid), _cpu_seconds(pid, pid), _busy_seconds(url), time.monotonic()

    async def main() -> None:
        await asyncio.gather(*(client(ws_url, rec, times, random.Random(i).uniform(0, 1), run)
                               for i, rec in enumerate(recs)))

    asyncio.run(main())
    elapsed = time.monotonic() - wall
    run.cpu = (_cpu_seconds(pid) - cpu) / elapsed
    run.loop_cpu = (_cpu_seconds(pid, pid) - loop_cpu) / elapsed
    run.busy = (_busy_seconds(url) - busy) / elapsed
    offline = []
    for _, samples in run.turns:
        buffer = io.BytesIO()
        sf.write(buffer, samples, SAMPLE_RATE, format="WAV", subtype="FLOAT")
        r = httpx.post(f"{url}/v1/audio/transcriptions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                       files={"file": ("turn.wav", buffer.getvalue())}, data={"language": "en"})
        offline.append(r.json()["text"])
    run.wer = _wer([t for t, _ in run.turns], offline)
    return run


# -- faster-whisper, one stream at a time -------------------------------------------------------
def faster_whisper_run(recs: list[Recording], times: dict, live_model, compute_type: str, threads: int) -> Run:
    from faster_whisper import WhisperModel

    from encdec_engine.checkpoints.ct2.bundled import bundled_model_dir
    from encdec_engine.speech.live.events import SpeechStopped, TranscriptCompleted, TranscriptDelta
    from encdec_engine.speech.live.options import LiveOptions
    from encdec_engine.speech.live.session import LiveSession

    model = WhisperModel(str(bundled_model_dir()), device="cpu", compute_type=compute_type, cpu_threads=threads)
    sot_prev = live_model.tokens.sot_prev

    def decode(request) -> tuple[list[int], float, float]:
        window = request.prompt["encoder_prompt"]["multi_modal_data"]["audio"][0]
        prompt = request.prompt["decoder_prompt"]["prompt_token_ids"]
        previous = prompt[1 : prompt.index(live_model.tokens.sot)] if prompt[0] == sot_prev else None
        segments, _ = model.transcribe(window, language="en", beam_size=1, best_of=1, temperature=0.0,
                                       condition_on_previous_text=False, initial_prompt=previous,
                                       without_timestamps=False, vad_filter=False,
                                       max_new_tokens=request.params.max_tokens)
        segments = list(segments)
        tokens = [t for s in segments for t in s.tokens]
        return tokens, (segments[0].no_speech_prob if segments else 0.0), (segments[0].avg_logprob if segments else 0.0)

    list(model.transcribe(recs[0].heard[: 3 * SAMPLE_RATE], language="en", beam_size=1)[0])  # warm-up
    sessions = [LiveSession(live_model, LiveOptions()) for _ in recs]
    chunks = [[rec.heard[k : k + int(SAMPLE_RATE * CHUNK)] for k in range(0, len(rec.heard), int(SAMPLE_RATE * CHUNK))]
              for rec in recs]
    events: list[list[tuple[float, object]]] = [[] for _ in recs]
    delays = [random.Random(i).uniform(0, 1) for i in range(len(recs))]
    fed, turn = [0] * len(recs), 0
    cpu, start = sum(os.times()[:2]), time.monotonic()
    t0s = [start + d for d in delays]
    while True:
        now = time.monotonic()
        for i, session in enumerate(sessions):  # the audio due by now, in order
            while fed[i] < len(chunks[i]) and t0s[i] + (fed[i] + 1) * CHUNK <= now:
                events[i] += [(now, e) for e in session.append(chunks[i][fed[i]])]
                fed[i] += 1
                if fed[i] == len(chunks[i]):
                    events[i] += [(now, e) for e in session.finish()]
        pending = [(i, s.next_request()) for i, s in enumerate(sessions)]
        due = [(i, r) for i, r in pending if r is not None]
        for i, r in due[1:]:
            sessions[i].drop(r)
        if due:  # one decode at a time, round-robin over the streams
            i, request = sorted(due, key=lambda d: (d[0] - turn) % len(recs))[0]
            turn = i + 1
            tokens, no_speech, logprob = decode(request)
            events[i] += [(time.monotonic(), e) for e in sessions[i].take(request, tokens, no_speech, logprob)]
        elif all(f == len(c) for f, c in zip(fed, chunks)) and all(s.idle for s in sessions):
            break
        else:
            time.sleep(0.01)
    run = Run(cpu=(sum(os.times()[:2]) - cpu) / (time.monotonic() - start))
    for i, rec in enumerate(recs):
        stopped = {e.item_id: t for t, e in events[i] if isinstance(e, SpeechStopped)}
        for t, e in events[i]:
            if not isinstance(e, TranscriptCompleted):
                continue
            deltas = [(dt, w) for dt, d in events[i] if isinstance(d, TranscriptDelta) and d.item_id == e.item_id
                      for w in map(_norm, d.delta.split()) if w]
            span = (e.audio_start_ms / 1000, e.audio_end_ms / 1000)
            lags, unmatched = lags_of(deltas, rec, times, t0s[i], span)
            run.lags += lags
            run.unmatched += unmatched
            run.completed.append(t - (t0s[i] + span[1]))
            run.early += any(dt < stopped.get(e.item_id, float("inf")) for dt, _ in deltas)
            run.turns.append((e.transcript, rec.heard[e.audio_start_ms * 16 : e.audio_end_ms * 16]))
            run.deltas.append(" ".join(w for _, w in deltas))
    offline = [" ".join(s.text for s in model.transcribe(samples, language="en", beam_size=1, vad_filter=False)[0])
               for _, samples in run.turns]
    run.wer = _wer([t for t, _ in run.turns], offline)
    return run


# -- reporting --------------------------------------------------------------------------------
def _wer(hypotheses: list[str], references: list[str]) -> float:
    import jiwer

    pairs = [(" ".join(map(_norm, r.split())), " ".join(map(_norm, h.split()))) for h, r in zip(hypotheses, references)]
    pairs = [(r, h) for r, h in pairs if r]
    return jiwer.wer([r for r, _ in pairs], [h for _, h in pairs]) if pairs else 0.0


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def real_time(run: Run) -> bool:
    return _pct(run.lags, 95) <= LAG_TARGET and _pct(run.completed, 95) <= COMPLETED_TARGET


def row(system: str, n: int, recs: list[Recording], run: Run) -> str:
    audio = sum(len(r.heard) for r in recs) / SAMPLE_RATE
    return (f"| {system} | {n} | {audio:.0f} | {len(run.lags)} | {_pct(run.lags, 50):.2f} / {_pct(run.lags, 95):.2f} / "
            f"{max(run.lags, default=float('nan')):.2f} | {_pct(run.completed, 50):.2f} / {_pct(run.completed, 95):.2f} / "
            f"{max(run.completed, default=float('nan')):.2f} | {100 * run.wer:.1f} | "
            f"{100 * _wer(run.deltas, [t for t, _ in run.turns]):.1f} | {run.early}/{len(run.turns)} | "
            f"{run.cpu:.2f} | {'-' if run.loop_cpu is None else f'{run.loop_cpu:.2f}'} | "
            f"{'-' if run.busy is None else f'{100 * run.busy:.0f}'} | "
            f"{'yes' if real_time(run) else 'no'} |")


def machine() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    wanted = [f for f in flags if f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8")]
    return f"{name}; {len(os.sched_getaffinity(0))} cores; flags: {' '.join(wanted) or 'none of avx2/avx512/amx'}"


def _busy_seconds(url: str) -> float:
    """The server's `encdec_engine_busy_seconds_total`: seconds its engine thread has spent in steps."""
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    return float(re.search(r"^encdec_engine_busy_seconds_total (\S+)$", text, re.M).group(1))


def _cpu_seconds(pid: int, thread: int | None = None) -> float:
    """CPU seconds of process `pid` so far, or of its thread `thread` (the main thread's id is the pid)."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="1,2,4,8,12,16,24,32", help="the N to run, in order")
    parser.add_argument("--quick", action="store_true", help="N = 1, 2 on two-clip recordings (a smoke run)")
    parser.add_argument("--quantization", choices=["int8"], default=None, help="int8 weights (faster-whisper: int8)")
    parser.add_argument("--compute-type", default=None, help="the engine's --compute-type (e.g. bfloat16, auto); "
                        "faster-whisper keeps float32 (int8 with --quantization)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="CPU threads of each system")
    parser.add_argument("--all", action="store_true", help="run every N, not stopping once one is past real time")
    parser.add_argument("--no-faster-whisper", action="store_true", help="the engine alone")
    parser.add_argument("--interim-padding", default="2", help="the server's --realtime-interim-padding: seconds "
                        "of padding the interim decodes read past the audio, or 'full' (the whole 30 s window)")
    args = parser.parse_args()
    counts = [1, 2] if args.quick else [int(n) for n in args.clients.split(",")]
    args.all = args.all or args.quick  # a smoke run shows both N whatever the machine
    print(f"machine: {machine()}")
    print(f"model: tiny.en (bundled); weights {args.compute_type or args.quantization or 'float32'}; {args.threads} threads; interim decodes read the audio + {args.interim_padding} s of padding; "
          f"chunks of {CHUNK * 1000:.0f} ms at real-time pace; targets: p95 word lag <= {LAG_TARGET} s, "
          f"p95 completed <= {COMPLETED_TARGET} s after the turn's audio ended")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "encdec_engine.cli.main", "serve", "--port", str(port), "--log-level", "warning",
           "--api-key", KEY, "--threads", str(args.threads), "--max-realtime-sessions", str(max(counts)),
           "--max-realtime-sessions-per-client", str(max(counts)),  # every simulated client is this machine
           "--no-prefix-caching"]  # stream i replays the same audio at every N: no final may come from the cache
    cmd += ["--quantization", args.quantization] if args.quantization else []
    cmd += ["--realtime-interim-padding", args.interim_padding]
    cmd += ["--compute-type", args.compute_type] if args.compute_type else []
    header = ("| system | N | audio s | words | word lag p50 / p95 / max s | completed p50 / p95 / max s | "
              "WER vs offline % | deltas WER vs completed % | turns with text before stop | CPU cores | "
              "event loop cores | engine busy % | real time |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows, best = [], {"engine": 0, "faster-whisper": 0}

    def sweep(system: str, measure) -> None:
        """`measure` (recordings -> Run) for each N in turn; stops past real time unless --all."""
        for n in counts:
            recs = recordings(n, args.quick)
            run = measure(recs)
            rows.append(row(system, n, recs, run))
            print(rows[-1], flush=True)
            if real_time(run):
                best[system] = n
            elif not args.all:
                break
    with tempfile.TemporaryDirectory() as tmp:
        server = subprocess.Popen(cmd, stdout=open(Path(tmp) / "server.log", "w"), stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            wait_healthy(url, server)
            times = word_times(url)
            sweep("engine", lambda recs: engine_run(url, recs, times, server.pid))
        finally:
            stop(server)  # killed if it has not exited within 30 s: never left running after the script
    if not args.no_faster_whisper:
        from encdec_engine.llm import LLM
        from encdec_engine.speech.live.model import LiveModel

        live_model = LiveModel(LLM(threads=args.threads, kv_cache_space_gb=0.1).engine)  # token facts only
        compute = "int8" if args.quantization else "float32"
        sweep("faster-whisper", lambda recs: faster_whisper_run(recs, times, live_model, compute, args.threads))
    print(f"\n{header}\n" + "\n".join(rows))
    print(f"\nlargest N in real time: engine {best['engine']}"
          + ("" if args.no_faster_whisper else f", faster-whisper one stream at a time {best['faster-whisper']}"))
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
