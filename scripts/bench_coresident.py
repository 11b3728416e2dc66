"""The engine's main job in a process where another runtime has run first: its time after over its time alone.

Applications load several runtimes into one process: CTranslate2 (faster-whisper), onnxruntime, numpy's
BLAS, another torch model. Each scenario is a fresh process: the engine (tiny.en, `--compute-type`,
default int8) transcribes long_meeting.flac (69 s) `--repeats` times (the best counts: "alone"), then
the other runtime does its work, then the engine transcribes again ("after"). Its transcript must not
change. The runtimes (each at 2 threads, the engine's count):

    none          nothing in between: the run-to-run drift of the engine alone (the baseline ratio)
    ctranslate2   CTranslate2's Whisper (the bundled tiny.en, int8) generates on three 30 s windows
    onnxruntime   Silero VAD's ONNX model (the silero-vad package's file) over the recording (needs
                  `pip install onnxruntime`; the row is left out without it)
    numpy         numpy's BLAS (OpenBLAS in numpy's wheels): 1024 x 1024 fp64 matmuls for 2 s
    torch-model   Hugging Face's WhisperForConditionalGeneration generates on the same windows

Scenarios take turns for `--rounds` rounds; the median ratio counts. Prints the CPU model and flags,
and torch's thread count before and after (a library that sets it changes the engine's speed).

    python scripts/bench_coresident.py [--rounds 3] [--compute-type int8|float32|bfloat16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from bench_whisper import ROOT, cpu_line

AUDIO = ROOT / "prompts" / "audio" / "long_meeting.flac"
SCENARIOS = ("none", "ctranslate2", "onnxruntime", "numpy", "torch-model")
THREADS = 2


def windows():
    """The recording's first three 30 s windows as Whisper log-mel features [3, 80, 3000] (torch)."""
    from encdec_engine.inputs.audio import load_audio
    from encdec_engine.inputs.features import log_mel_spectrogram

    audio = load_audio(AUDIO)
    return log_mel_spectrogram([audio[i * 480000:(i + 1) * 480000] for i in range(3)])


def run_ctranslate2() -> None:
    import ctranslate2

    from encdec_engine.checkpoints.ct2.bundled import bundled_model_dir

    model = ctranslate2.models.Whisper(str(bundled_model_dir()), device="cpu", compute_type="int8",
                                       intra_threads=THREADS)
    features = ctranslate2.StorageView.from_array(windows().numpy())
    model.generate(features, [[50257, 50362]] * 3, beam_size=1, max_length=224)


def run_onnxruntime() -> None:
    import importlib.util

    import numpy as np
    import onnxruntime

    from encdec_engine.inputs.audio import load_audio

    # The package's file, found without importing it: importing silero_vad sets torch's threads to 1 for
    # the process (the engine puts its count back: machine/threads.keep_threads).
    path = importlib.util.find_spec("silero_vad").submodule_search_locations[0] + "/data/silero_vad.onnx"
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = THREADS
    session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    audio = load_audio(AUDIO)
    state = np.zeros((2, 1, 128), dtype=np.float32)
    for start in range(0, len(audio) - 512, 512):
        chunk = audio[None, start:start + 512].astype(np.float32)
        _, state = session.run(None, {"input": chunk, "state": state, "sr": np.array(16000, dtype=np.int64)})


def run_numpy() -> None:
    import numpy as np

    a = np.random.default_rng(0).standard_normal((1024, 1024))
    end = time.perf_counter() + 2.0
    while time.perf_counter() < end:
        a = a @ a
        a /= np.abs(a).max()


def run_torch_model() -> None:
    import torch
    from transformers import WhisperForConditionalGeneration

    from encdec_engine.checkpoints.ct2.importer import default_model_path

    model = WhisperForConditionalGeneration.from_pretrained(default_model_path()).eval()
    with torch.no_grad():
        model.generate(input_features=windows(), max_new_tokens=96)


def worker(scenario: str, compute_type: str, repeats: int) -> dict:
    import torch

    from encdec_engine import LLM
    from encdec_engine.checkpoints.ct2.importer import default_model_path

    llm = LLM(model=str(default_model_path()), compute_type=compute_type, threads=THREADS,
              enable_prefix_caching=False)

    def job() -> tuple[float, str]:
        best, text = float("inf"), ""
        for _ in range(repeats):
            start = time.perf_counter()
            text = llm.transcribe([AUDIO], temperatures=(0.0,))[0].text
            best = min(best, time.perf_counter() - start)
        return best, text

    job()  # warm-up: first-call allocations, the decode kernel, lazy imports
    alone, before = job()
    threads = torch.get_num_threads()
    start = time.perf_counter()
    {"none": lambda: None, "ctranslate2": run_ctranslate2, "onnxruntime": run_onnxruntime, "numpy": run_numpy,
     "torch-model": run_torch_model}[scenario]()
    other = time.perf_counter() - start
    after, text = job()
    return {"alone": alone, "after": after, "other_s": other, "same_text": text == before,
            "torch_threads": (threads, torch.get_num_threads())}


def available(scenario: str) -> bool:
    module = {"ctranslate2": "ctranslate2", "onnxruntime": "onnxruntime"}.get(scenario)
    if module is None:
        return True
    import importlib.util

    return importlib.util.find_spec(module) is not None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2, help="transcriptions per timing (the best counts)")
    ap.add_argument("--compute-type", default="int8")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.compute_type, args.repeats)))
        return 0
    print(cpu_line(), flush=True)
    scenarios = [s for s in args.scenarios.split(",") if available(s)]
    left_out = [s for s in args.scenarios.split(",") if s not in scenarios]
    if left_out:
        print(f"left out (not installed): {', '.join(left_out)}")
    results: dict[str, list[dict]] = {s: [] for s in scenarios}
    for _ in range(args.rounds):
        for scenario in scenarios:
            out = subprocess.run([sys.executable, __file__, "--worker", scenario, "--compute-type", args.compute_type,
                                  "--repeats", str(args.repeats)], capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            results[scenario].append(r)
            print(f"  {scenario}: alone {r['alone']:.2f} s, after {r['after']:.2f} s ({r['after'] / r['alone']:.2f}x), "
                  f"other {r['other_s']:.2f} s, same text {r['same_text']}", flush=True)
    print(f"\nengine {args.compute_type}, tiny.en, {AUDIO.name}, {THREADS} threads; best of {args.repeats} per timing, "
          f"median of {args.rounds} rounds")
    print(f"{'after':<14}{'alone s':>9}{'after s':>9}{'after/alone':>13}{'other s':>9}  same text, torch threads")
    for scenario, runs in results.items():
        ratio = statistics.median(r["after"] / r["alone"] for r in runs)
        print(f"{scenario:<14}{statistics.median(r['alone'] for r in runs):>9.2f}"
              f"{statistics.median(r['after'] for r in runs):>9.2f}{ratio:>12.2f}x"
              f"{statistics.median(r['other_s'] for r in runs):>9.2f}  {all(r['same_text'] for r in runs)}, "
              f"{runs[0]['torch_threads']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
