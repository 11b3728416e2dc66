"""Load test of the OpenAI-compatible server: concurrent clients mixing transcription and completion.

Starts two servers on loopback ports (`encdec serve` in subprocesses: the default Whisper
tiny.en, and a BART checkpoint; without --bart-model a small random-init BART is made in a
temporary folder), or connects to running ones (--whisper-url / --bart-url, loopback only).
Then N requests (bounded count and wall time) from C concurrent clients of the official
`openai` client: transcriptions of the bundled clips in prompts/audio (some streamed) and
completions of the bundled documents (some streamed). Prints p50/p99 latency per kind,
throughput and errors; exits 1 unless there were no errors and, once idle, every server
reports no request in its queues and no KV block in use (read from /metrics).

With --hostile-share F, a share F of extra requests are hostile (huge lists, seeds out of range,
an oversized prompt, uploads cut off mid-body, clients that leave mid-stream); they must be refused
with a 4xx or cleanly dropped, never a 5xx. --compare runs the good requests alone first, then
with the hostile share, and exits 1 unless the good ones had no error in both runs and their p99
latency with the hostile share is within 1.5x of the p99 without.

Two attacks as scenarios of their own, each run beside the good load and measured:
--slow-clients N opens N uploads that send their headers and 5 bytes, then stall (the good load runs
meanwhile: every good upload must succeed, each stalled one must get 408, and the audio memory they
hold is read from /metrics); --amplification sends the one small completion request that used to
make the server build a 50 MB answer (256 prompts x n=16 x the model's length, 20 logprobs): it must
be refused, and the largest request the budget admits is sent and measured (request and response
bytes, the server's resident memory before and after).

    python scripts/load_test.py --requests 48 --concurrency 8
    python scripts/load_test.py --requests 48 --concurrency 8 --hostile-share 0.25 --compare
    python scripts/load_test.py --requests 24 --concurrency 4 --slow-clients 16 --amplification
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
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
    cmd = [sys.executable, "-m", "encdec_engine.cli.main", "serve", "--host", "127.0.0.1", "--port",
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


class Hostile:
    """Requests a careless or hostile client sends. Each returns what the server did ("400", "429",
    "dropped"...); a 5xx raises, as an error of the run."""

    KINDS = ("huge_lists", "bad_seed", "huge_prompt", "truncated_upload", "leaves_stream", "leaves_upload")

    def __init__(self, client: Client, whisper_url: str, bart_url: str, api_key: str) -> None:
        self.client, self.whisper_url, self.bart_url = client, whisper_url, bart_url
        self.auth = {"Authorization": f"Bearer {api_key}"}

    async def send(self, kind: str, i: int) -> str:
        return await getattr(self, kind)(i)

    async def _post(self, body: dict) -> str:
        async with httpx.AsyncClient(timeout=300) as http:
            r = await http.post(f"{self.bart_url}/v1/completions", json={"model": "bart", **body}, headers=self.auth)
        if r.status_code >= 500:
            raise RuntimeError(f"{r.status_code} for a hostile request: {r.text[:200]}")
        return str(r.status_code)

    async def huge_lists(self, i: int) -> str:
        field = ("stop", "stop_token_ids", "bad_words", "logit_bias")[i % 4]
        value = {"stop": ["x"] * 100_000, "stop_token_ids": [5] * 100_000, "bad_words": ["w"] * 100_000,
                 "logit_bias": {str(t): 1 for t in range(100_000)}}[field]
        return await self._post({"prompt": "A huge list.", "max_tokens": 4, field: value})

    async def bad_seed(self, i: int) -> str:
        return await self._post({"prompt": "A seed out of range.", "max_tokens": 4, "seed": 2**64 + i})

    async def huge_prompt(self, i: int) -> str:
        return await self._post({"prompt": "word " * 400_000, "max_tokens": 4})

    async def truncated_upload(self, i: int) -> str:
        """Headers that promise a whole clip, half of it, then the connection closes."""
        data = self.client.clips[i % len(self.client.clips)]
        url = urlparse(self.whisper_url)
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
        head = (f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: {url.hostname}\r\nContent-Length: {len(data) + 200}"
                f"\r\nAuthorization: {self.auth['Authorization']}\r\n"
                "Content-Type: multipart/form-data; boundary=cut\r\n\r\n--cut\r\n"
                'Content-Disposition: form-data; name="file"; filename="cut.wav"\r\n\r\n')
        writer.write(head.encode() + data[: len(data) // 2])
        await writer.drain()
        writer.close()
        await writer.wait_closed()
        return "dropped"

    async def leaves_stream(self, i: int) -> str:
        """A streamed completion left after its first chunk."""
        chunks = await self.client.bart.completions.create(model="bart", prompt=self.client.paragraphs[i % len(self.client.paragraphs)],
                                                           max_tokens=64, temperature=0.0, stream=True)
        async for _ in chunks:
            break
        await chunks.close()
        return "left"

    async def leaves_upload(self, i: int) -> str:
        """A streamed transcription left after its first event."""
        name, data = CLIPS[i % len(CLIPS)], self.client.clips[i % len(self.client.clips)]
        events = await self.client.whisper.audio.transcriptions.create(model="whisper-1", file=(name, data),
                                                                      stream=True)
        async for _ in events:
            break
        await events.close()
        return "left"


async def stalled_uploads(whisper_url: str, api_key: str, count: int, seconds: float) -> list[str]:
    """`count` uploads that send their headers and 5 bytes, then wait up to `seconds` for an answer:
    the status line each got ("HTTP/1.1 408 ...") or "no answer"."""
    url = urlparse(whisper_url)

    async def one() -> str:
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
        head = (f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: {url.hostname}\r\nContent-Length: 5000000\r\n"
                f"Authorization: Bearer {api_key}\r\nContent-Type: multipart/form-data; boundary=cut\r\n\r\n--cut\r\n")
        writer.write(head.encode())
        await writer.drain()
        try:
            line = await asyncio.wait_for(reader.readline(), seconds)
            return line.decode().strip() or "closed"
        except asyncio.TimeoutError:
            return "no answer"
        finally:
            writer.close()

    return await asyncio.gather(*(one() for _ in range(count)))


def slow_clients(whisper_url: str, api_key: str, count: int, client_load) -> int:
    """The good load with `count` stalled uploads open beside it; returns the number of failures."""
    async def both():
        stalled = asyncio.ensure_future(stalled_uploads(whisper_url, api_key, count, 120.0))
        await asyncio.sleep(1.0)
        held = read_metrics(whisper_url, api_key).get('encdec_audio_memory_bytes{kind="used"}', 0)
        start = time.monotonic()
        results = await client_load()
        return await stalled, results, held, time.monotonic() - start

    answers, results, held, wall = asyncio.run(both())
    good = [r for r in results if r[0].startswith("transcription")]
    failed = [r for r in good if r[2] is not None]
    codes = {a: answers.count(a) for a in sorted(set(answers))}
    print(f"\n== {count} stalled uploads (headers and 5 bytes each)")
    print(f"audio memory they held 1 s in: {held:.0f} bytes (an earlier main reserved each Content-Length, "
          f"{count} x 5 MB)")
    print(f"good transcriptions beside them: {len(good) - len(failed)} of {len(good)} answered "
          f"(p99 {percentile([r[1] for r in good if r[2] is None] or [0.0], 99):.2f} s) in {wall:.1f} s")
    print(f"the stalled uploads got: {codes}")
    return len(failed) + sum(n for a, n in codes.items() if " 408 " not in f"{a} ")


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def amplification(bart_url: str, api_key: str, pid: int | None) -> int:
    """The small request that asked for gigabytes must be refused; the largest admitted one is measured."""
    auth = {"Authorization": f"Bearer {api_key}"}
    limits = httpx.get(f"{bart_url}/v1/models", headers=auth, timeout=30).json()["data"][0]
    model_len = limits["max_model_len"]
    attack = {"model": "bart", "prompt": ["x"] * 256, "n": 16, "max_tokens": model_len, "logprobs": 20,
              "temperature": 1.0, "ignore_eos": True}
    failures = 0
    print("\n== amplification")
    for body in (attack, {**attack, "logprobs": 5}):
        request = json.dumps(body).encode()
        r = httpx.post(f"{bart_url}/v1/completions", content=request, headers={**auth, "Content-Type": "application/json"},
                       timeout=600)
        print(f"{len(request)} B request (256 prompts x n=16 x max_tokens {model_len}, logprobs {body['logprobs']}): "
              f"{r.status_code}, {len(r.content)} B answer: {r.json()['error']['message'][:120]}")
        failures += r.status_code != 400
    budget = 65536  # the default --max-request-tokens
    prompts, n, logprobs = 64, 4, 5
    max_tokens = min(model_len, budget // (prompts * n * (1 + logprobs)))
    body = {"model": "bart", "prompt": ["The council met."] * prompts, "n": n, "max_tokens": max_tokens,
            "logprobs": logprobs, "temperature": 1.0, "ignore_eos": True, "seed": 1}
    before = rss_kb(pid) if pid else 0
    request = json.dumps(body).encode()
    start = time.monotonic()
    r = httpx.post(f"{bart_url}/v1/completions", content=request, headers={**auth, "Content-Type": "application/json"},
                   timeout=600)
    after = rss_kb(pid) if pid else 0
    tokens = r.json().get("usage", {}).get("completion_tokens", 0) if r.status_code == 200 else 0
    print(f"the largest admitted ({prompts} prompts x n={n} x max_tokens {max_tokens}, logprobs {logprobs}: "
          f"{prompts * n * max_tokens * (1 + logprobs)} of the {budget} budget): {r.status_code} in "
          f"{time.monotonic() - start:.1f} s, {len(request)} B request -> {len(r.content)} B answer "
          f"({len(r.content) / len(request):.0f}x), {tokens} tokens"
          + (f", server RSS {before / 1024:.0f} -> {after / 1024:.0f} MB" if pid else ""))
    return failures + (r.status_code != 200)


async def run_load(client: Client, num_requests: int, concurrency: int, timeout: float,
                   hostile: Hostile | None = None, hostile_share: float = 0.0) -> list[tuple]:
    gate = asyncio.Semaphore(concurrency)
    results: list[tuple] = []  # (kind, seconds, error or None, hostile outcome or None)

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
            results.append((kind + (" (stream)" if stream else ""), time.monotonic() - start, error, None))

    async def bad(i: int, kind: str) -> None:
        async with gate:
            start = time.monotonic()
            try:
                outcome, error = await hostile.send(kind, i), None
            except Exception as e:
                outcome, error = None, f"{type(e).__name__}: {e}"
            results.append((f"hostile {kind}", time.monotonic() - start, error, outcome))

    rng = random.Random(0)
    num_hostile = round(num_requests * hostile_share / (1 - hostile_share)) if hostile is not None else 0
    work = [one(i) for i in range(num_requests)] + [bad(i, Hostile.KINDS[i % len(Hostile.KINDS)])
                                                    for i in range(num_hostile)]
    rng.shuffle(work)  # the hostile requests arrive among the good ones
    await asyncio.wait_for(asyncio.gather(*work), timeout)
    return results


def percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def report(results: list[tuple], wall: float, tokens: float, audio_seconds: float) -> tuple[int, float]:
    """Prints the run; returns (errors, p99 latency of the good requests)."""
    errors = [r for r in results if r[2] is not None]
    good = [r for r in results if not r[0].startswith("hostile")]
    print(f"\n{len(good)} good requests (+{len(results) - len(good)} hostile) in {wall:.1f} s: "
          f"{len(good) / wall:.2f} req/s, {tokens / wall:.1f} generated tokens/s, "
          f"{audio_seconds / wall:.1f} s of audio per s; errors: {len(errors)}")
    print(f"{'kind':<30}{'n':>4}{'p50 s':>9}{'p99 s':>9}{'max s':>9}")
    kinds = sorted({r[0] for r in good}) + ["all good"]
    for kind in kinds:
        lat = [r[1] for r in good if (kind == "all good" or r[0] == kind) and r[2] is None]
        if lat:
            print(f"{kind:<30}{len(lat):>4}{percentile(lat, 50):>9.2f}{percentile(lat, 99):>9.2f}{max(lat):>9.2f}")
    outcomes: dict[str, dict[str, int]] = {}
    for kind, _, _, outcome in results:
        if outcome is not None:
            outcomes.setdefault(kind, {}).setdefault(outcome, 0)
            outcomes[kind][outcome] += 1
    for kind, counts in sorted(outcomes.items()):
        print(f"{kind:<30}" + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    for kind, _, error, _ in errors[:10]:
        print(f"error ({kind}): {error}")
    good_latency = [r[1] for r in good if r[2] is None]
    return len(errors), percentile(good_latency, 99) if good_latency else float("inf")


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
    parser.add_argument("--hostile-share", type=float, default=0.0,
                        help="share of all requests that are hostile (added to --requests good ones)")
    parser.add_argument("--compare", action="store_true",
                        help="run the good requests alone first; gate: with the hostile share, p99 <= 1.5x")
    parser.add_argument("--slow-clients", type=int, default=0,
                        help="also run the good load beside this many stalled uploads (each must get 408)")
    parser.add_argument("--body-grace-s", type=float, default=10.0, help="the Whisper server's --body-grace-s")
    parser.add_argument("--amplification", action="store_true",
                        help="also send the small request that asks for gigabytes, and the largest one admitted")
    args = parser.parse_args()
    if not 1 <= args.requests <= 10_000 or not 1 <= args.concurrency <= 512:
        raise SystemExit("--requests must be in [1, 10000] and --concurrency in [1, 512]")
    if not 0 <= args.hostile_share < 1:
        raise SystemExit("--hostile-share must be in [0, 1)")
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
        whisper_url = serve(args.whisper_model, args.whisper_url, "whisper-1",
                            ["--kv-cache-space-gb", "0.5", "--body-grace-s", str(args.body_grace_s)])
        bart_url = serve(bart_model, args.bart_url, "bart", ["--kv-cache-space-gb", "0.25"])
        for url in (whisper_url, bart_url):
            wait_healthy(url, procs.get(url))
        audio_seconds = sum(_duration(CLIPS[(i // 2) % len(CLIPS)]) for i in range(0, args.requests, 2))
        def generated() -> float:
            return sum(read_metrics(u, args.api_key).get("encdec_generated_tokens_total", 0)
                       for u in (whisper_url, bart_url))

        async def session(num_requests: int, share: float) -> list[tuple]:
            client = Client(whisper_url, bart_url, args.api_key)  # its connections belong to this event loop
            hostile = Hostile(client, whisper_url, bart_url, args.api_key) if share else None
            try:
                return await run_load(client, num_requests, args.concurrency, args.timeout, hostile, share)
            finally:
                await client.whisper.close()
                await client.bart.close()

        async def session_coroutine(num_requests: int) -> list[tuple]:
            return await session(num_requests, 0.0)

        def run(share: float) -> tuple[int, float]:
            before = generated()
            start = time.monotonic()
            results = asyncio.run(session(args.requests, share))
            wall = time.monotonic() - start
            return report(results, wall, generated() - before, audio_seconds)

        warm = asyncio.run(session(min(args.requests, 2 * args.concurrency), 0.0))  # first calls are slow
        if any(r[2] for r in warm):
            print(f"warm-up error: {next(r[2] for r in warm if r[2])}")
        errors, slow = 0, False
        if args.compare:
            print("== the good requests alone")
            errors, p99_alone = run(0.0)
            print(f"== with a hostile share of {args.hostile_share:g}")
        more_errors, p99 = run(args.hostile_share)
        errors += more_errors
        if args.compare:
            ratio = p99 / p99_alone
            slow = ratio > 1.5
            print(f"p99 of the good requests: {p99:.2f} s with the hostile share vs {p99_alone:.2f} s without: "
                  f"{ratio:.2f}x ({'over' if slow else 'within'} the 1.5x bound)")
        if args.slow_clients:
            errors += slow_clients(whisper_url, args.api_key, args.slow_clients,
                                   lambda: session_coroutine(args.requests))
        if args.amplification:
            pid = procs[bart_url].pid if bart_url in procs else None
            errors += amplification(bart_url, args.api_key, pid)
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
    return 1 if errors or leaks or slow else 0


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
