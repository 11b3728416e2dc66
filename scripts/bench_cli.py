"""The one-file job as a user runs it: a whole process, from start to transcript on disk.

`bench_whisper.py` times transcription alone (model load reported apart, a warm-up first); a
user of `encdec transcribe meeting.wav` waits for the interpreter, the imports, the model
load, the first (cold) transcription and the output files too. Here each system runs as a
fresh process on long_meeting (69 s; with `--long-minutes N` also bench_whisper.py's recording of
about N minutes), sequential long-form, greedy, 2 threads, timed from spawn to exit, the systems
taking turns for `--rounds` rounds (best and median kept):

    encdec transcribe FILE [--quantization int8 | --compute-type auto] -o DIR --output-format txt
                    (auto: the machine's fastest floating type, bf16 where native and faster)
    faster-whisper: the few lines a user writes (WhisperModel(...).transcribe, beam_size=1,
                    the text written to a file), fp32 and int8, in its own venv
    whisper.cpp:    the same through pywhispercpp with the ggml f16 file (optional)

Then one instrumented engine process splits its time: importing torch, importing the engine,
building the LLM (config, tokenizer, weights, int8 quantization, kernel choice), the first
transcription, and a second one of the same file (the steady state `bench_whisper.py` reports;
no encoder-output reuse); and it says whether anything imported transformers (the Whisper path
should not). Printed: CPU model and flags, each system's wall seconds, its ratio to
faster-whisper int8 (above 1: the row is faster), and its WER against the spoken text.

    python scripts/bench_cli.py --fw-python peer-venvs/fw/bin/python \\
        [--whispercpp-python P --ggml-model F] [--rounds 3] [--threads 2] [--long-minutes 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_whisper import ROOT, build_long, cpu_line, wer

FW_SCRIPT = """
import sys
from faster_whisper import WhisperModel
model_dir, compute, threads, audio, out = sys.argv[1:6]
model = WhisperModel(model_dir, device="cpu", compute_type=compute, cpu_threads=int(threads))
segments, _ = model.transcribe(audio, beam_size=1, language="en")
open(out, "w").write(" ".join(s.text.strip() for s in segments))
"""

WHISPERCPP_SCRIPT = """
import sys
import soundfile
from pywhispercpp.model import Model
model_file, threads, audio, out = sys.argv[1:5]
model = Model(model_file, redirect_whispercpp_logs_to=None, n_threads=int(threads), language="en",
              print_progress=False, print_realtime=False)
samples, _ = soundfile.read(audio, dtype="float32")  # its own reader takes 16-bit wav files only
open(out, "w").write(" ".join(s.text.strip() for s in model.transcribe(samples)))
"""

PHASES_SCRIPT = """
import json, sys, time
marks = [("start", time.perf_counter())]
import torch
marks.append(("import torch", time.perf_counter()))
from encdec_engine import LLM
from encdec_engine.checkpoints.ct2.importer import default_model_path
marks.append(("import encdec_engine", time.perf_counter()))
torch.set_num_threads(int(sys.argv[2]))
# No encoder-output reuse: the second pass then redoes the whole job, as bench_whisper.py times it.
llm = LLM(model=str(default_model_path()), quantization=sys.argv[3] or None, enable_prefix_caching=False)
marks.append(("build the LLM", time.perf_counter()))
for name in ("first transcription", "second transcription"):
    llm.transcribe(sys.argv[1], language="en")
    marks.append((name, time.perf_counter()))
print(json.dumps({"phases": [(name, t - prev) for (name, t), (_, prev) in zip(marks[1:], marks)],
                  "transformers imported": "transformers" in sys.modules}))
"""


def bundled_ct2() -> str:
    from encdec_engine.checkpoints.ct2.bundled import bundled_model_dir

    return str(bundled_model_dir())


def commands(args, audio: Path, out: Path) -> dict[str, tuple[list[str], Path]]:
    """Each system's command line and the file its transcript lands in."""
    def engine(name: str, *extra: str) -> tuple[list[str], Path]:
        folder = out / name
        return ([sys.executable, "-m", "encdec_engine.cli", "transcribe", str(audio), "--language", "en",
                 "--threads", str(args.threads), "-o", str(folder), "--output-format", "txt", *extra],
                folder / f"{audio.stem}.txt")

    rows = {"encdec transcribe (fp32)": engine("fp32"),
            "encdec transcribe --quantization int8": engine("int8", "--quantization", "int8"),
            "encdec transcribe --compute-type auto": engine("auto", "--compute-type", "auto")}
    if args.fw_python:
        for compute in ("float32", "int8"):
            file = out / f"fw-{compute}.txt"
            rows[f"faster-whisper {compute}"] = ([args.fw_python, "-c", FW_SCRIPT, bundled_ct2(), compute,
                                                  str(args.threads), str(audio), str(file)], file)
    if args.whispercpp_python and args.ggml_model:
        file = out / "whispercpp.txt"
        rows["whisper.cpp f16"] = ([args.whispercpp_python, "-c", WHISPERCPP_SCRIPT, args.ggml_model,
                                    str(args.threads), str(audio), str(file)], file)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fw-python", help="python of a venv with faster-whisper")
    ap.add_argument("--whispercpp-python", help="python of a venv with pywhispercpp")
    ap.add_argument("--ggml-model", help="ggml file of the same tiny.en weights")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--long-minutes", type=float, default=0.0,
                    help="also a recording of about this many minutes (bench_whisper.py's; 0: long_meeting only)")
    args = ap.parse_args()
    for flag, python in (("--fw-python", args.fw_python), ("--whispercpp-python", args.whispercpp_python)):
        if python and not os.access(python, os.X_OK):
            ap.error(f"{flag} {python}: not an executable file")

    print(cpu_line())
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for audio in build_long(args.long_minutes, tmp):
            run_file(args, audio, tmp / audio.path.stem)
    return 0


# Starts the command from a small process and reports its peak RSS. Linux carries a process's peak RSS
# over fork and exec: a command spawned straight from this script (which may hold hundreds of MB after
# building a long recording) reported this script's peak as its own (632 MB for every system).
LAUNCHER = """
import os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def timed_run(cmd: list[str], env: dict) -> tuple[float, float, int, str]:
    """(wall seconds from spawn to exit, peak resident MB, exit code, stderr) of one process (started by
    LAUNCHER: its start, a few ms, counts in the wall time of every system alike)."""
    with tempfile.TemporaryFile("w+") as err, tempfile.NamedTemporaryFile("r") as peak:
        start = time.perf_counter()
        code = subprocess.run([sys.executable, "-c", LAUNCHER, peak.name, *cmd], env=env, stdout=subprocess.DEVNULL,
                              stderr=err, text=True).returncode
        wall = time.perf_counter() - start
        err.seek(0)
        return wall, int(peak.read() or 0) / 1024, code, err.read()


def run_file(args, audio, out: Path) -> None:
    """Every system on one recording, in turn for `args.rounds` rounds; then the engine's phases."""
    out.mkdir()
    rows = commands(args, audio.path, out)
    walls: dict[str, list[float]] = {name: [] for name in rows}
    peaks: dict[str, list[float]] = {name: [] for name in rows}  # MB
    texts: dict[str, str] = {}
    failed: set[str] = set()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
    for _ in range(args.rounds):
        for name, (cmd, file) in rows.items():
            if name in failed:
                continue
            wall, rss, code, stderr = timed_run(cmd, env)
            if code != 0:
                print(f"{name}: failed: {(stderr.strip().splitlines() or ['no output'])[-1][:200]}")
                failed.add(name)
                continue
            walls[name].append(wall)
            peaks[name].append(rss)
            texts[name] = file.read_text()
    phases = subprocess.run([sys.executable, "-c", PHASES_SCRIPT, str(audio.path), str(args.threads), "int8"],
                            env=env, capture_output=True, text=True, check=True)

    print(f"\n{audio.path.name}: {audio.seconds:.1f} s of audio; each system a fresh process, spawn to exit; greedy, "
          f"language en; best and median of {args.rounds} rounds")
    print(f"{'system':<40}{'best s':>8}{'median s':>10}{'x fw int8':>11}{'peak MB':>9}{'x fw RSS':>10}{'WER %':>7}")
    reference = min(walls.get("faster-whisper int8") or [float("nan")])
    reference_rss = max(peaks.get("faster-whisper int8") or [float("nan")])
    for name, w in walls.items():
        if name in failed:
            continue
        rss = max(peaks[name])
        print(f"{name:<40}{min(w):8.2f}{statistics.median(w):10.2f}{reference / min(w):11.2f}{rss:9.0f}"
              f"{rss / reference_rss:10.2f}{wer([audio.text], [texts[name]]):7.2f}")
    print("x fw int8: faster-whisper int8's best wall time over the row's (above 1: the row is faster); peak MB: "
          "the process's largest resident set; x fw RSS: over faster-whisper int8's")
    print("\nencdec (int8), one instrumented process:")
    split = json.loads(phases.stdout.strip().splitlines()[-1])
    for name, seconds in split["phases"]:
        print(f"  {name:<24}{seconds:6.2f} s")
    print(f"  transformers imported: {'yes' if split['transformers imported'] else 'no'}")


if __name__ == "__main__":
    sys.exit(main())
