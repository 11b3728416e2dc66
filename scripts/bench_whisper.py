"""Whisper on the CPU, the engine in fp32 and int8 against every CPU peer, one run, same weights.

Two workloads, all on the bundled tiny.en weights (HF import for the engine, HF and, converted,
openai-whisper and whisper.cpp; the CTranslate2 original for faster-whisper), greedy:

    (a) clips   --num-clips short English clips (the bundled WAVs plus sentences synthesized with
                espeak-ng, fixed voices and speeds) transcribed as ONE batch where the system can
                batch: no timestamps, no temperature fallback (the engine's HF-exact settings)
    (b) long    the main job: one recording at a time, sequential long-form with each system's
                own defaults (timestamps, temperature fallback, conditioning on the text so far):
                prompts/audio/long_meeting.flac (69 s) and a --long-minutes recording made of
                synthesized sentences in several voices
    (c) vad     long-form with VAD: --vad-recordings recordings of --vad-minutes minutes (speech,
                pauses, noise) through the engine (vad_filter, chunked; fp32 and int8) and
                faster-whisper's BatchedInferencePipeline (fp32 and int8), by scripts/bench_vad.py
                in this Python (faster-whisper from the project's `bench` extra)

Every system runs in a process of its own (`scripts/bench_systems.py`), peers with the Python of
their own venv (--fw-python, --whispercpp-python, --openai-python; a peer without one is left
out), so nothing but the system being timed shares the process. Model load is timed apart; one
untimed warm-up precedes the timed passes; the best of --repeats is kept. Printed: CPU model
and flags, the engine's kernel choice, then per workload each system's seconds, audio seconds
per second, WER against the spoken text, agreement with the engine's fp32 output (and with HF
for the clips), and its time relative to the engine, then the issue's targets with every ratio.

Peer setup (once; see the README's Performance section):
    python -m venv peer-venvs/fw && peer-venvs/fw/bin/pip install faster-whisper soundfile
    python -m venv peer-venvs/whispercpp && .../bin/pip install pywhispercpp==1.5.1 numpy soundfile
    python -m venv peer-venvs/openai && .../bin/pip install torch==2.13.0 openai-whisper soundfile
    and a ggml f16 file and an openai-whisper .pt converted from the engine's tiny.en folder.

    python scripts/bench_whisper.py --fw-python P --whispercpp-python P --ggml-model F \\
        --openai-python P --openai-model F [--threads 2] [--num-clips 44] [--repeats 3] [--rounds 1] [--long-minutes 5]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import soundfile as sf

ROOT = Path(__file__).resolve().parent.parent
AUDIO_DIR = ROOT / "prompts" / "audio"
WORKER = Path(__file__).resolve().parent / "bench_systems.py"
SAMPLE_RATE = 16000

# Short, digit-free sentences: Whisper writes numbers as numerals, which would count as
# errors against spelled-out references and blur the WER comparison.
SENTENCES = (
    "Please turn off the lights before you leave the office.",
    "The train to the city leaves from the north platform.",
    "Can you send me the report by the end of the day?",
    "We need more time to finish the design review.",
    "My sister lives in a small house near the river.",
    "The children played in the garden until it got dark.",
    "Remember to water the plants while I am away.",
    "The new library opens next month in the town center.",
    "He forgot his umbrella and got wet in the rain.",
    "Our flight was delayed because of the storm.",
    "Could you please speak a little more slowly?",
    "The doctor said I should drink more water and sleep longer.",
    "This recipe needs butter, sugar, flour and a few eggs.",
    "The museum is closed on Mondays.",
    "She reads a book every night before going to bed.",
    "The price of fresh vegetables went up again this week.",
    "Let me know if you have any questions about the plan.",
    "A cold wind blew across the empty field.",
    "The software update fixed most of the problems we reported.",
    "Good night, and see you tomorrow morning.",
    "Bring a warm jacket because the mountains are cold in the evening.",
    "The cat jumped onto the table and knocked over a glass of milk.",
    "We should check the figures again before sending the invoice.",
    "Every student must hand in the essay before the holiday break begins.",
    "The old bridge was repaired and opened to traffic last spring.",
)
# (espeak-ng voice, words per minute), cycled over the sentences for varied speakers and pace.
VOICES = (
    ("en-us", 150), ("en-us+m3", 165), ("en-us+f2", 140), ("en-gb", 155),
    ("en-us+f3", 175), ("en-us+m1", 130), ("en-gb+f4", 160),
)


@dataclass(frozen=True)
class Audio:
    path: Path  # 16 kHz mono wav
    text: str  # what is spoken
    seconds: float


@dataclass(frozen=True)
class System:
    name: str
    worker: str  # bench_systems.py SYSTEMS key
    python: str
    model: str
    options: dict = field(default_factory=dict)


@dataclass
class Result:
    system: System
    load_s: float = 0.0
    seconds: float = float("nan")
    texts: list[str] = field(default_factory=list)
    tokens: list | None = None
    info: str = ""
    error: str = ""


# ---------------------------------------------------------------- audio


def write_wav(samples: np.ndarray, path: Path) -> float:
    sf.write(path, samples.astype(np.float32), SAMPLE_RATE, subtype="FLOAT")
    return len(samples) / SAMPLE_RATE


def speak(text: str, voice: str, speed: int, tmp: Path) -> np.ndarray:
    import librosa

    raw = tmp / "espeak.wav"
    subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-w", str(raw), text], check=True, capture_output=True)
    return librosa.load(raw, sr=SAMPLE_RATE)[0]  # espeak writes 22.05 kHz


def build_clips(count: int, tmp: Path) -> list[Audio]:
    from encdec_engine.inputs.audio import load_audio

    refs = json.loads((AUDIO_DIR / "transcripts.json").read_text())
    clips = []
    for src in sorted(AUDIO_DIR.glob("*.wav"))[:count]:
        path = tmp / f"clip_{len(clips):03d}.wav"
        clips.append(Audio(path, refs[src.name], write_wav(load_audio(src), path)))
    for i in range(count - len(clips)):
        # Past the sentence list, repeats move to the next voice so no two clips are identical.
        text = SENTENCES[i % len(SENTENCES)]
        voice, speed = VOICES[(i + i // len(SENTENCES)) % len(VOICES)]
        path = tmp / f"clip_{len(clips):03d}.wav"
        clips.append(Audio(path, text, write_wav(speak(text, voice, speed, tmp), path)))
    return clips


def build_long(minutes: float, tmp: Path) -> list[Audio]:
    """long_meeting.flac, and a recording of about `minutes` made of the sentences in turn, each
    voice speaking a few, with pauses between them."""
    from encdec_engine.inputs.audio import load_audio

    refs = json.loads((AUDIO_DIR / "transcripts.json").read_text())
    meeting = tmp / "long_meeting.wav"
    out = [Audio(meeting, refs["long_meeting.flac"], write_wav(load_audio(AUDIO_DIR / "long_meeting.flac"), meeting))]
    if minutes <= 0:
        return out
    pieces, texts, total, i = [], [], 0.0, 0
    while total < 60 * minutes:
        voice, speed = VOICES[(i // 3) % len(VOICES)]
        samples = speak(SENTENCES[i % len(SENTENCES)], voice, speed, tmp)
        pause = np.zeros(int(SAMPLE_RATE * (0.4 if i % 3 else 1.2)), dtype=np.float32)
        pieces += [samples, pause]
        texts.append(SENTENCES[i % len(SENTENCES)])
        total += (len(samples) + len(pause)) / SAMPLE_RATE
        i += 1
    path = tmp / f"recording_{minutes:g}min.wav"
    out.append(Audio(path, " ".join(texts), write_wav(np.concatenate(pieces), path)))
    return out


# ---------------------------------------------------------------- running


def run(system: System, workload: str, audio: list[Audio], threads: int, repeats: int, tmp: Path) -> Result:
    job = tmp / "job.json"
    out = tmp / "out.json"
    out.unlink(missing_ok=True)
    job.write_text(json.dumps({"workload": workload, "audio": [str(a.path) for a in audio], "threads": threads,
                               "repeats": repeats, "model": system.model, "options": system.options}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run([system.python, str(WORKER), system.worker, str(job), str(out)], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_file():
        return Result(system, error=(proc.stderr.strip().splitlines() or ["no output"])[-1][:200])
    data = json.loads(out.read_text())
    return Result(system, data["load_s"], min(data["seconds"]), data["texts"], data["tokens"], data["info"])


def run_rounds(rows: list[System], workload: str, audio: list[Audio], args, tmp: Path) -> list[Result]:
    """Every system `args.rounds` times, in turn, so that a busy spell of a shared machine hurts them
    alike rather than whichever system it fell on; a system's fastest run counts."""
    best: dict[str, Result] = {}
    for _ in range(args.rounds):
        for system in rows:
            result = run(system, workload, audio, args.threads, args.repeats, tmp)
            old = best.get(system.name)
            if old is None or (not result.error and (old.error or result.seconds < old.seconds)):
                best[system.name] = result
    return [best[system.name] for system in rows]


def systems(args) -> list[System]:
    from encdec_engine.checkpoints.ct2.bundled import bundled_model_dir
    from encdec_engine.checkpoints.ct2.importer import default_model_path

    hf_dir = str(default_model_path())
    me = sys.executable
    rows = [System("engine fp32", "engine", me, hf_dir),
            System("engine int8", "engine", me, hf_dir, {"quantization": "int8"})]
    if args.kv_int8:
        rows.append(System("engine int8 + int8 KV", "engine", me, hf_dir,
                           {"quantization": "int8", "kv_cache_dtype": "int8"}))
    rows.append(System(f"hf generate bs={args.hf_batch_size}", "hf", me, hf_dir, {"batch_size": args.hf_batch_size}))
    if args.fw_python:
        ct2 = str(bundled_model_dir())
        for compute in ("float32", "int8"):
            rows.append(System(f"faster-whisper {compute}", "faster-whisper", args.fw_python, ct2,
                               {"compute_type": compute}))
            rows.append(System(f"fw batched {compute}", "faster-whisper", args.fw_python, ct2,
                               {"compute_type": compute, "batched": True, "batch_size": args.fw_batch_size}))
    if args.whispercpp_python and args.ggml_model:
        rows.append(System("whisper.cpp f16", "whispercpp", args.whispercpp_python, args.ggml_model))
    if args.openai_python and args.openai_model:
        rows.append(System("openai-whisper fp32", "openai-whisper", args.openai_python, args.openai_model))
    return rows


# ---------------------------------------------------------------- report


def normalize(text: str) -> str:
    text = re.sub(r"[^\w\s']|_", " ", text.lower()).replace("'", "")  # "don't" and "dont" match
    return " ".join(text.split())


def wer(refs: list[str], hyps: list[str]) -> float:
    import jiwer

    return 100 * jiwer.wer([normalize(r) for r in refs], [normalize(h) or "<empty>" for h in hyps])


def cpu_line() -> str:
    import torch

    from encdec_engine.machine.cpu_kernels import cpu_model

    flags = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    shown = sorted(f for f in flags if re.match(r"avx|fma|f16c|amx|sse4_2", f))
    return (f"CPU: {cpu_model()}, {os.cpu_count()} cores; flags: {' '.join(shown)}; "
            f"torch {torch.__version__} CPU capability {torch.backends.cpu.get_cpu_capability()}")


def table(title: str, results: list[Result], audio: list[Audio], hf: Result | None) -> dict[str, Result]:
    seconds = sum(a.seconds for a in audio)
    ok = {r.system.name: r for r in results if not r.error}
    fp32, int8 = ok.get("engine fp32"), ok.get("engine int8")
    print(f"\n{title}: {len(audio)} file(s), {seconds:.1f} s of audio")
    print(f"{'system':<24}{'load s':>7}{'seconds':>9}{'audio s/s':>10}{'WER %':>7}{'WER vs fp32':>12}"
          f"{'same as fp32':>13}{'same as HF':>11}{'x fp32':>8}{'x int8':>8}")
    for r in results:
        if r.error:
            print(f"{r.system.name:<24}  failed: {r.error}")
            continue
        refs = [a.text for a in audio]
        vs_fp32 = wer(fp32.texts, r.texts) if fp32 else float("nan")

        def same(other: Result | None) -> str:
            if other is None:
                return "-"
            if r.tokens is None or other.tokens is None:
                return f"{sum(normalize(a) == normalize(b) for a, b in zip(r.texts, other.texts))}/{len(audio)} txt"
            return f"{sum(a == b for a, b in zip(r.tokens, other.tokens))}/{len(audio)}"

        print(f"{r.system.name:<24}{r.load_s:7.2f}{r.seconds:9.2f}{seconds / r.seconds:10.1f}{wer(refs, r.texts):7.2f}"
              f"{vs_fp32:12.2f}{same(fp32):>13}{same(hf):>11}"
              f"{r.seconds / fp32.seconds if fp32 else float('nan'):8.2f}"
              f"{r.seconds / int8.seconds if int8 else float('nan'):8.2f}")
    print("x fp32 / x int8: the row's seconds over the engine's (above 1: the engine is faster); "
          "WER vs fp32: the row's text against the engine fp32 text")
    return ok


def best(ok: dict[str, Result], names: list[str]) -> Result | None:
    found = [ok[n] for n in names if n in ok]
    return min(found, key=lambda r: r.seconds) if found else None


def targets(clips: dict[str, Result], clip_audio: list[Audio], longs: list[tuple[Audio, dict[str, Result]]]) -> None:
    print("\ntargets:")
    fp32, int8 = clips.get("engine fp32"), clips.get("engine int8")
    fw8 = best(clips, ["faster-whisper int8", "fw batched int8"])
    fw32 = best(clips, ["faster-whisper float32", "fw batched float32"])
    refs = [a.text for a in clip_audio]
    if int8 and fw8:
        print(f"  (a) engine int8 vs faster-whisper's best int8 ({fw8.system.name}): "
              f"{fw8.seconds / int8.seconds:.2f}x (target >= 1.3)")
    if int8 and fp32:
        print(f"  (a) WER engine int8 - engine fp32: {wer(refs, int8.texts) - wer(refs, fp32.texts):+.2f} points "
              "(target <= 0.5)")
    if fp32 and fw32:
        print(f"  (a) engine fp32 vs faster-whisper's best fp32 ({fw32.system.name}): "
              f"{fw32.seconds / fp32.seconds:.2f}x (target >= 1.5)")
    for audio, ok in longs:
        for engine in ("engine fp32", "engine int8"):
            if engine not in ok:
                continue
            for peer in ("faster-whisper int8", "whisper.cpp f16"):
                if peer in ok:
                    e, p = ok[engine], ok[peer]
                    print(f"  (b) {audio.path.name}: {engine} vs {peer}: {p.seconds / e.seconds:.2f}x "
                          f"(target > 1; WER {wer([audio.text], e.texts):.2f} vs {wer([audio.text], p.texts):.2f})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-clips", type=int, default=44)
    ap.add_argument("--long-minutes", type=float, default=5.0, help="length of the second long recording (0: none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="timed passes per system and workload; the best counts")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the systems this many times in turn (each in a fresh process); the best counts")
    ap.add_argument("--hf-batch-size", type=int, default=8)
    ap.add_argument("--fw-batch-size", type=int, default=16, help="faster-whisper BatchedInferencePipeline batch")
    ap.add_argument("--kv-int8", action="store_true", help="also run the engine with int8 weights and an int8 KV cache")
    ap.add_argument("--fw-python", help="python of a venv with faster-whisper")
    ap.add_argument("--whispercpp-python", help="python of a venv with pywhispercpp")
    ap.add_argument("--ggml-model", help="whisper.cpp ggml file of the same weights (f16)")
    ap.add_argument("--openai-python", help="python of a venv with openai-whisper")
    ap.add_argument("--openai-model", help="openai-whisper .pt of the same weights")
    ap.add_argument("--vad-minutes", type=float, default=10.0, help="(c): length of each VAD recording")
    ap.add_argument("--vad-recordings", type=int, default=1, help="(c): recordings (more: a steadier WER)")
    ap.add_argument("--skip", default="", help="comma-separated workloads to skip: clips, long, vad")
    args = ap.parse_args()
    if args.num_clips < 1 or args.repeats < 1 or args.rounds < 1:
        ap.error("--num-clips, --repeats and --rounds must be positive")
    skip = set(filter(None, args.skip.split(",")))
    sys.stdout.reconfigure(line_buffering=True)  # rows appear as they finish, also when piped
    print(cpu_line())
    print(f"{args.threads} threads per system, greedy, tiny.en; best of {args.repeats} timed passes after a warm-up"
          + (f", in each of {args.rounds} rounds over the systems" if args.rounds > 1 else ""))
    rows = systems(args)
    with tempfile.TemporaryDirectory(prefix="bench_whisper_") as name:
        tmp = Path(name)
        clip_results, longs = {}, []
        if "clips" not in skip:
            clips = build_clips(args.num_clips, tmp)
            results = run_rounds(rows, "clips", clips, args, tmp)
            for r in results[:2]:
                if r.info:
                    print(f"{r.system.name}: {r.info}")
            hf = next((r for r in results if r.system.worker == "hf" and not r.error), None)
            clip_results = table("(a) short clips, one batch", results, clips, hf)
        if "long" not in skip:
            for audio in build_long(args.long_minutes, tmp):
                results = run_rounds(rows, "long", [audio], args, tmp)
                longs.append((audio, table(f"(b) main job: {audio.path.name}, sequential long-form", results,
                                           [audio], None)))
        targets(clip_results, clips if "clips" not in skip else [], longs)
    if "vad" not in skip:
        # (c) long-form with VAD against faster-whisper's BatchedInferencePipeline: scripts/bench_vad.py, which
        # runs faster-whisper in this Python (the project's `bench` extra), after everything above.
        print(f"\n(c) long-form with VAD: {args.vad_recordings} recording(s) of {args.vad_minutes:g} min "
              "(scripts/bench_vad.py)")
        vad = subprocess.run([sys.executable, str(Path(__file__).with_name("bench_vad.py")), "--minutes",
                              str(args.vad_minutes), "--recordings", str(args.vad_recordings), "--threads",
                              str(args.threads), "--repeats", str(args.repeats)])
        if vad.returncode:
            print(f"(c) failed with exit status {vad.returncode}")
            return vad.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
