"""Load test of the OpenAI-compatible server: concurrent clients mixing transcription and completion.

Starts two servers on loopback ports (`encdec serve` in subprocesses: the default Whisper
tiny.en, and a BART checkpoint; without --bart-model a small random-init BART is made in a
temporary folder), or connects to running ones (--whisper-url / --bart-url, loopback only).
Then N requests (bounded count and wall time) from C concurrent clients of the official
`openai` client: transcriptions of the bundled clips in prompts/audio (some streamed) and
completions of the bundled documents (some streamed). Prints p50/p99 latency per kind,
throughput and errors; exits 1 unless there were no errors and, once idle, every server
reports no request in its queues and no KV block in use (read from /metrics).

    python scripts/load_test.py --requests 48 --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from urllib.parse import urlparse

import httpx
import openai

ROOT = Path(__file__).resolve().parent.parent
AUDIO = ROOT / "prompts" / "audio"
CLIPS = ["fox.wav", "weather.wav", "stella.wav", "learning.wav", "thanks_fast.wav", "coffee.wav",
         "meeting_stereo_44k.wav"]
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, extra: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "encdec_engine.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port",
           str(port), "--log-level", "warning", *extra] + (["--model", model] if model else [])
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"server for {url} exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"server {url} not healthy after {timeout:.0f} s")


def read_metrics(url: str, api_key: str) -> dict[str, float]:
    """The server's metrics (with an API key set, /metrics needs it too)."""
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {api_key}"}, timeout=10).text
    values = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+(?:\{[^}]*\})?) (\S+)$", line)
        if m:
            values[m.group(1)] = float(m.group(2))
    return values


def check_idle(url: str, api_key: str, timeout: float = 10.0) -> str | None:
    """None when the server has nothing queued and every KV block free; else what is left."""
    deadline = time.monotonic() + timeout
    while True:
        m = read_metrics(url, api_key)
        busy = {k: m[k] for k in ("encdec_requests_waiting", "encdec_requests_running", "encdec_requests_swapped",
                                  "encdec_server_queue_size") if m.get(k)}
        used = m['encdec_kv_blocks_used{kind="self"}'] + m['encdec_kv_blocks_used{kind="cross"}']
        free, total = m['encdec_kv_blocks_free{pool="device"}'], m['encdec_kv_blocks_total{pool="device"}']
        if not busy and used == 0 and free == total:
            return None
        if time.monotonic() > deadline:
            return f"{url}: busy={busy} kv blocks used={used:g} free={free:g}/{total:g}"
        time.sleep(0.2)


class Client:
    def __init__(self, whisper_url: str, bart_url: str, api_key: str) -> None:
        self.whisper = openai.AsyncOpenAI(base_url=f"{whisper_url}/v1", api_key=api_key, max_retries=0, timeout=300)
        self.bart = openai.AsyncOpenAI(base_url=f"{bart_url}/v1", api_key=api_key, max_retries=0, timeout=300)
        self.clips = [(AUDIO / name).read_bytes() for name in CLIPS]
        # Passages of three sentences from the bundled documents: they fit any BART's positions.
        docs = [p.read_text() for p in sorted((ROOT / "prompts" / "documents").glob("*.txt"))]
        sentences = [s for d in docs for s in re.split(r"(?<=[.!?])\s+", d.strip()) if s]
        self.paragraphs = [" ".join(sentences[i:i + 3]) for i in range(0, len(sentences), 3)]

    async def transcribe(self, i: int, stream: bool) -> int:
        name, data = CLIPS[i % len(CLIPS)], self.clips[i % len(self.clips)]
        if stream:
            events = await self.whisper.audio.transcriptions.create(model="whisper-1", file=(name, data),
                                                                   stream=True)
            text = "".join([e.delta async for e in events if e.type == "transcript.text.delta"])
        else:
            text = (await self.whisper.audio.transcriptions.create(model="whisper-1", file=(name, data))).text
        if not text.strip():
            raise RuntimeError(f"empty transcript of {name}")
        return 0

    async def complete(self, i: int, stream: bool) -> int:
        prompt = self.paragraphs[i % len(self.paragraphs)]
        if stream:
            chunks = await self.bart.completions.create(model="bart", prompt=prompt, max_tokens=32, temperature=0.0,
                                                        stream=True)
            return sum([1 async for c in chunks if c.choices and c.choices[0].text])
        out = await self.bart.completions.create(model="bart", prompt=prompt, max_tokens=32, temperature=0.0)
        return out.usage.completion_tokens


async def run_load(client: Client, num_requests: int, concurrency: int, timeout: float) -> list[tuple]:
    gate = asyncio.Semaphore(concurrency)
    results: list[tuple] = []  # (kind, seconds, error or None)

    async def one(i: int) -> None:
        kind = ("transcription", "completion")[i % 2]
        stream = i % 3 == 0
        async with gate:
            start = time.monotonic()
            try:
                await (client.transcribe if kind == "transcription" else client.complete)(i // 2, stream)
                error = None
            except Exception as e:  # counted, reported below
                error = f"{type(e).__name__}: {e}"
            results.append((kind + (" (stream)" if stream else ""), time.monotonic() - start, error))

    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(num_requests))), timeout)
    return results


def percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def report(results: list[tuple], wall: float, tokens: float, audio_seconds: float) -> int:
    errors = [r for r in results if r[2] is not None]
    print(f"\n{len(results)} requests in {wall:.1f} s: {len(results) / wall:.2f} req/s, "
          f"{tokens / wall:.1f} generated tokens/s, {audio_seconds / wall:.1f} s of audio per s; "
          f"errors: {len(errors)}")
    print(f"{'kind':<26}{'n':>4}{'p50 s':>9}{'p99 s':>9}{'max s':>9}")
    kinds = sorted({r[0] for r in results}) + ["all"]
    for kind in kinds:
        lat = [r[1] for r in results if (kind == "all" or r[0] == kind) and r[2] is None]
        if lat:
            print(f"{kind:<26}{len(lat):>4}{percentile(lat, 50):>9.2f}{percentile(lat, 99):>9.2f}{max(lat):>9.2f}")
    for kind, _, error in errors[:10]:
        print(f"error ({kind}): {error}")
    return len(errors)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48, help="total requests (half of each kind)")
    parser.add_argument("--concurrency", type=int, default=8, help="clients in flight at once")
    parser.add_argument("--timeout", type=float, default=600.0, help="wall-clock bound for the whole load")
    parser.add_argument("--whisper-model", default=None, help="default: the offline Whisper tiny.en")
    parser.add_argument("--bart-model", default=None, help="default: a small random-init BART")
    parser.add_argument("--whisper-url", default=None, help="use this running server instead (loopback)")
    parser.add_argument("--bart-url", default=None, help="use this running server instead (loopback)")
    parser.add_argument("--api-key", default="load-test-key")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="servers recompute every encoder output (the clips repeat, so caching hits)")
    args = parser.parse_args()
    if not 1 <= args.requests <= 10_000 or not 1 <= args.concurrency <= 512:
        raise SystemExit("--requests must be in [1, 10000] and --concurrency in [1, 512]")
    for url in (args.whisper_url, args.bart_url):
        if url and urlparse(url).hostname not in LOOPBACK:
            raise SystemExit(f"{url}: this load test only talks to loopback servers")

    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        procs: dict[str, subprocess.Popen] = {}

        def serve(model: str | None, url: str | None, name: str, extra: list[str]) -> str:
            if url:
                return url.rstrip("/")
            if args.no_prefix_caching:
                extra = [*extra, "--no-prefix-caching"]
            proc, url = start_server(model, ["--api-key", args.api_key, "--served-model-name", name, *extra],
                                     Path(tmp) / f"{name}.log")
            procs[url] = proc
            stack.callback(stop, proc)
            return url

        bart_model = args.bart_model
        if bart_model is None and args.bart_url is None:
            sys.path.insert(0, str(ROOT / "tests"))
            from helpers import make_bart

            bart_model = str(make_bart(Path(tmp) / "bart"))
        whisper_url = serve(args.whisper_model, args.whisper_url, "whisper-1", ["--kv-cache-space-gb", "0.5"])
        bart_url = serve(bart_model, args.bart_url, "bart", ["--kv-cache-space-gb", "0.25"])
        for url in (whisper_url, bart_url):
            wait_healthy(url, procs.get(url))
        client = Client(whisper_url, bart_url, args.api_key)
        audio_seconds = sum(_duration(CLIPS[(i // 2) % len(CLIPS)]) for i in range(0, args.requests, 2))
        def generated() -> float:
            return sum(read_metrics(u, args.api_key).get("encdec_generated_tokens_total", 0)
                       for u in (whisper_url, bart_url))

        before = generated()
        start = time.monotonic()
        results = asyncio.run(run_load(client, args.requests, args.concurrency, args.timeout))
        wall = time.monotonic() - start
        tokens = generated() - before
        errors = report(results, wall, tokens, audio_seconds)
        for url in (whisper_url, bart_url):
            cache = {k: v for k, v in read_metrics(url, args.api_key).items()
                     if k.startswith("encdec_prefix_cache_total")}
            if cache:
                print(f"prefix cache {url}: " + ", ".join(f"{k.split('=')[1][1:-2]}={v:g}" for k, v in cache.items()))
        leaks = [msg for msg in (check_idle(u, args.api_key) for u in (whisper_url, bart_url)) if msg]
        for msg in leaks:
            print(f"not idle after the load: {msg}")
        if not leaks:
            print("after the load: no request queued or running, every KV block free (self and cross)")
    return 1 if errors or leaks else 0


def _duration(name: str) -> float:
    import soundfile

    return soundfile.info(AUDIO / name).duration


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
