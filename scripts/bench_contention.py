"""Sharing the cores: the one-file job while other work runs on the same machine, as a ratio to the same
job alone, beside faster-whisper's ratios in the same situations.

Each job is a whole process timed from spawn to exit, as a user runs it (long_meeting.flac, 69 s;
greedy; int8, or fp32 with `--compute-type float32`; each system's default thread count):

    engine          encdec transcribe FILE --quantization int8 -o DIR --output-format txt
    engine, fixed   the same with ENCDEC_FIT_THREADS=0: its thread count not fitted to the free cores
                    (machine/threads.py CoreShare), as before that existed (`--fixed`)
    faster-whisper  WhisperModel(..., compute_type="int8").transcribe(FILE, beam_size=1), in its own venv

Situations (the ratio is the job's time over its time alone; 2.0 is a fair share of a machine whose
cores the two jobs split):

    alone                 one job
    2 at once, 3 at once  that many jobs of the same system started together (their mean time)
    beside the other      one job while the other system (faster-whisper, or the engine) transcribes in a loop
    beside a busy loop    one job while a Python busy loop runs (one core's worth of other work)
    beside the server     (engine) one job while `encdec serve` answers a stream of transcriptions

Systems and situations take turns within each of `--rounds` rounds; medians are printed, with the
CPU model and flags first. Nothing is cached across jobs but the imported model (as for a user).

    python scripts/bench_contention.py --fw-python peer-venvs/fw/bin/python [--fixed] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_whisper import ROOT, cpu_line

AUDIO = ROOT / "prompts" / "audio" / "long_meeting.flac"
CLIP = ROOT / "prompts" / "audio" / "weather.wav"
ENCDEC = Path(sys.executable).with_name("encdec")

FW_SCRIPT = """
import sys
from faster_whisper import WhisperModel
model_dir, compute, audio, out = sys.argv[1:5]
model = WhisperModel(model_dir, device="cpu", compute_type=compute)
segments, _ = model.transcribe(audio, beam_size=1, language="en")
open(out, "w").write(" ".join(s.text.strip() for s in segments))
"""
BUSY_SCRIPT = "while True:\n    pass\n"
CLIENT_SCRIPT = """
import sys, httpx
url, clip = sys.argv[1:3]
data = open(clip, "rb").read()
with httpx.Client(timeout=120) as http:
    while True:
        http.post(url + "/v1/audio/transcriptions", files={"file": ("clip.wav", data)}, data={"model": "whisper-1"})
"""


class Systems:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.work, self.count = args, work, 0

    def command(self, system: str) -> list[str]:
        """A fresh output folder each job: nothing a job writes is read by the next."""
        self.count += 1
        out = self.work / f"out-{self.count}"
        if system.startswith("engine"):
            quantization = ["--quantization", "int8"] if self.args.compute_type == "int8" else []
            fixed = ["env", "ENCDEC_FIT_THREADS=0"] if system == "engine, fixed" else []
            return [*fixed, str(ENCDEC), "transcribe", str(AUDIO), *quantization, "-o", str(out), "--output-format",
                    "txt"]
        from encdec_engine.checkpoints.ct2.bundled import bundled_model_dir

        return [self.args.fw_python, "-c", FW_SCRIPT, str(bundled_model_dir()), self.args.compute_type, str(AUDIO),
                str(out) + ".txt"]

    def names(self) -> list[str]:
        return ["engine"] + ["engine, fixed"] * self.args.fixed + ["faster-whisper"] * bool(self.args.fw_python)


def timed(commands: list[list[str]]) -> list[float]:
    """Start the commands together; each one's seconds from spawn to exit."""
    start = time.monotonic()
    procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for c in commands]
    ends = []
    for p in procs:
        _, err = p.communicate()
        if p.returncode:
            raise RuntimeError(f"{' '.join(commands[0][:3])} ... failed: {err.decode()[-1500:]}")
        ends.append(time.monotonic() - start)
    return ends


def beside(background: list[str], command: list[str], settle: float = 1.0) -> float:
    """`command`'s seconds while `background` runs (started `settle` s before, killed after)."""
    other = subprocess.Popen(background, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(settle)
        return timed([command])[0]
    finally:
        other.kill()
        other.wait()


def loop_of(command: list[str]) -> list[str]:
    """A process running `command` again and again."""
    return ["bash", "-c", 'while "$@" >/dev/null 2>&1; do :; done', "loop", *command]


def start_server(port: int) -> subprocess.Popen:
    import httpx

    server = subprocess.Popen([str(ENCDEC), "serve", "--port", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.kill()
    raise RuntimeError("the server did not start")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fw-python", default=None, help="a Python with faster-whisper installed")
    parser.add_argument("--compute-type", default="int8", choices=["int8", "float32"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fixed", action="store_true", help="also the engine with its thread count not fitted")
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    print(cpu_line())
    print(f"cores usable: {len(os.sched_getaffinity(0))}; {AUDIO.name}; {args.compute_type}; rounds {args.rounds}")
    results: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        systems = Systems(args, Path(tmp))
        names = systems.names()
        timed([systems.command(n) for n in names[:1]])  # the model's first import and the kernel build
        server = start_server(args.port)
        server_load = [sys.executable, "-c", CLIENT_SCRIPT, f"http://127.0.0.1:{args.port}", str(CLIP)]
        try:
            for round_ in range(args.rounds):
                for name in names:
                    other = ["faster-whisper" if name != "faster-whisper" else "engine"]
                    other = [n for n in other if n in names]
                    cases = {
                        "alone": lambda: timed([systems.command(name)])[0],
                        "2 at once": lambda: statistics.mean(timed([systems.command(name) for _ in range(2)])),
                        "3 at once": lambda: statistics.mean(timed([systems.command(name) for _ in range(3)])),
                        "beside a busy loop": lambda: beside([sys.executable, "-c", BUSY_SCRIPT],
                                                             systems.command(name)),
                    }
                    if other:
                        cases[f"beside {other[0]}"] = lambda: beside(loop_of(systems.command(other[0])),
                                                                      systems.command(name), settle=3.0)
                    if name.startswith("engine"):
                        cases["beside the server"] = lambda: beside(server_load, systems.command(name))
                    for situation, run in cases.items():
                        seconds = run()
                        results.setdefault((name, situation), []).append(seconds)
                        print(f"round {round_ + 1}: {name:14s} {situation:22s} {seconds:6.2f} s", flush=True)
        finally:
            server.kill()
            server.wait()
    situations = list(dict.fromkeys(s for _, s in results))
    print(f"\n{'situation':22s}" + "".join(f" {n + ' s':>18s} {'ratio':>6s}" for n in names))
    for situation in situations:
        row = f"{situation:22s}"
        for name in names:
            times = results.get((name, situation))
            if times is None:
                row += f" {'-':>18s} {'-':>6s}"
                continue
            alone = statistics.median(results[(name, "alone")])
            row += f" {statistics.median(times):18.2f} {statistics.median(times) / alone:6.2f}"
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
