"""Peak memory of transcription as the number and length of inputs grow (issue 14: bounded resources).

Offline: `LLM.transcribe` of 1 and of N copies of `prompts/audio/long_meeting.flac` (69 s), each in
a fresh process, reading inputs as the audio budget allows (the default) and, for comparison, with
the budget lifted (every input read before decoding starts, as before). Prints each process's peak
RSS (VmHWM) and checks the transcripts agree.

Server: `encdec serve` with the default limits, then K concurrent streamed uploads of a 1-hour MP3
(the 69 s file looped); once every upload has its first event or its answer, prints the server's
RSS and peak RSS, the audio memory it accounts for (/metrics) and how many uploads were admitted or
refused (429), then the same with --max-audio-memory-mb 1024.

    python scripts/measure_memory.py --files 50 --uploads 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
LONG = ROOT / "prompts" / "audio" / "long_meeting.flac"

_OFFLINE = """
import json, sys
from encdec_engine import LLM
from encdec_engine.speech import inputs
if sys.argv[2] == "eager":
    inputs.LOADED_SECONDS = float("inf")
files = [sys.argv[1]] * int(sys.argv[3])
llm = LLM(num_kv_blocks=2000)
texts = [t.text for t in llm.transcribe(files, language="en")]
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"peak_kb": peak, "texts": sorted(set(texts))}))
"""


def offline(files: int, mode: str) -> dict:
    r = subprocess.run([sys.executable, "-c", _OFFLINE, str(LONG), mode, str(files)], capture_output=True, text=True,
                       cwd=ROOT, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in kB."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0])
    return values


def one_hour_mp3(folder: Path) -> Path:
    path = folder / "hour.mp3"
    subprocess.run(["ffmpeg", "-v", "error", "-stream_loop", "60", "-i", str(LONG), "-t", "3600", "-ac", "1",
                    "-ar", "16000", "-b:a", "32k", str(path)], check=True)
    return path


def server_run(upload: Path, uploads: int, extra: list[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "encdec_engine.cli.main", "serve", "--port", str(port),
                             "--log-level", "warning", *extra], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("the server did not start")
            time.sleep(0.3)
        idle = status(proc.pid)
        data = upload.read_bytes()
        outcomes: list[str] = []
        ready = threading.Barrier(uploads + 1)
        stop = threading.Event()

        def client() -> None:
            try:
                with httpx.Client(timeout=600) as http, http.stream(
                        "POST", f"{url}/v1/audio/transcriptions", files={"file": ("hour.mp3", data)},
                        data={"model": "whisper-1", "stream": "true"}) as r:
                    if r.status_code != 200:
                        outcomes.append(str(r.status_code))
                        ready.wait()
                        return
                    lines = r.iter_lines()  # one iterator, read to the end of the test: a client that
                    first = next(line for line in lines if line)  # stops reading is one that left
                    outcomes.append("streaming" if '"error"' not in first else f"error event: {first[:200]}")
                    ready.wait()
                    for _ in lines:  # the job stays alive (and its audio held) until measured
                        if stop.is_set():
                            break
            except threading.BrokenBarrierError:
                pass

        threads = [threading.Thread(target=client) for _ in range(uploads)]
        for t in threads:
            t.start()
        try:
            ready.wait(timeout=900)
        except threading.BrokenBarrierError:
            raise SystemExit(f"not every upload got an answer in 900 s: {outcomes}") from None
        busy = status(proc.pid)
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        held = re.search(r'encdec_audio_memory_bytes\{kind="used"\} (\d+)', metrics)
        stop.set()
        for t in threads:
            t.join()
        counts = {o: outcomes.count(o) for o in sorted(set(outcomes))}
        print(f"  server {' '.join(extra) or '(default limits)'}: {uploads} uploads of 1 h -> {counts}; RSS idle "
              f"{idle['VmRSS'] / 1024:.0f} MB, with the uploads decoding {busy['VmRSS'] / 1024:.0f} MB, peak "
              f"{busy['VmHWM'] / 1024:.0f} MB; audio memory held {int(held.group(1)) / 2**20:.0f} MB")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=50)
    parser.add_argument("--uploads", type=int, default=8)
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--skip-server", action="store_true")
    args = parser.parse_args()
    print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    if not args.skip_offline:
        print(f"offline, {LONG.name} (69 s) x N, peak RSS of the process:")
        runs = {(1, "lazy"): offline(1, "lazy"), (args.files, "lazy"): offline(args.files, "lazy"),
                (args.files, "eager"): offline(args.files, "eager")}
        for (n, mode), r in runs.items():
            print(f"  {n:>3} files, inputs read {'as the budget allows' if mode == 'lazy' else 'all first':<22}"
                  f"{r['peak_kb'] / 1024:8.0f} MB")
        texts = {tuple(r["texts"]) for r in runs.values()}
        print(f"  transcripts {'agree' if len(texts) == 1 else 'DIFFER'} across the runs")
        if len(texts) != 1:
            return 1
    if not args.skip_server:
        with tempfile.TemporaryDirectory() as tmp:
            upload = one_hour_mp3(Path(tmp))
            print(f"server, {upload.stat().st_size / 2**20:.1f} MB MP3 of 1 h per upload:")
            server_run(upload, args.uploads, [])
            server_run(upload, args.uploads, ["--max-audio-memory-mb", "1024"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
