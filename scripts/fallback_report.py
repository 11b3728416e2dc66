"""Temperature fallback, window by window: the engine beside faster-whisper on the same recordings.

Sequential long-form with each system's defaults (temperatures 0.0, 0.2, ... 1.0; best_of 5 samples
above 0; compression ratio over 2.4 or mean log-probability under -1.0 retries; greedy at 0), tiny.en,
the engine with int8 weights and faster-whisper int8 (the main job's comparison). Every decode request
each system makes is recorded (the engine's requests as they enter it; faster-whisper's calls into
CTranslate2), grouped by window (the seek it decodes from), and printed with the sampled tokens, so
that a difference in cost shows where it comes from: which windows fall back, how far, with how many
samples, and how many tokens that costs. Counts, not timings: the machine may be busy.

    python scripts/fallback_report.py [--minutes 1.3,1.5] [--built repeated_phrase,thanks_ten_times] [--threads 2]

--built adds the recordings tests/recordings.py makes for the fidelity tests, built to fall back
(a phrase said four times; one clip ten times).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from bench_whisper import Audio, build_long, write_wav

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


class Recorder:
    """Wraps CTranslate2's Whisper model: every generate call's temperature, samples and tokens."""

    def __init__(self, model) -> None:
        self.model, self.calls = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def generate(self, features, prompts, **kwargs):
        out = self.model.generate(features, prompts, **kwargs)
        temperature = kwargs.get("sampling_temperature", 1.0) if kwargs.get("beam_size", 1) == 1 else 0.0
        samples = kwargs.get("num_hypotheses", 1)
        tokens = sum(len(s) for r in out for s in r.sequences_ids)
        self.calls.append((temperature if kwargs.get("sampling_topk", 1) != 1 else 0.0, samples, tokens))
        return out


def faster_whisper_run(path: Path, threads: int) -> list[list[tuple[float, int, int]]]:
    from faster_whisper import WhisperModel

    from encdec_engine.checkpoints.ct2.bundled import bundled_model_dir

    model = WhisperModel(str(bundled_model_dir()), device="cpu", compute_type="int8", cpu_threads=threads)
    recorder = Recorder(model.model)
    model.model = recorder
    windows, seen = [], 0
    segments, _ = model.transcribe(str(path), language="en")
    for segment in segments:  # a window's calls are made before its segments come out
        if len(recorder.calls) > seen:
            windows.append(recorder.calls[seen:])
            seen = len(recorder.calls)
    if len(recorder.calls) > seen:
        windows.append(recorder.calls[seen:])
    return windows


def engine_run(path: Path, threads: int) -> list[list[tuple[float, int, int]]]:
    from encdec_engine import LLM

    llm = LLM(quantization="int8", enable_prefix_caching=False, threads=threads)
    engine, requests = llm.engine, []
    add = engine.add_processed

    def recording(request_id, request, arrival_time=None):
        p = request.params
        requests.append((request_id, p.temperature, max(p.best_of, p.num_beams)))
        return add(request_id, request, arrival_time)

    engine.add_processed = recording
    step, tokens = engine.step, defaultdict(int)

    def counting():
        outs = step()
        for out in outs:
            if out.finished:
                tokens[out.request_id] = sum(len(c.token_ids) for c in out.outputs)
        return outs

    engine.step = counting
    llm.transcribe([str(path)], language="en")
    # A window's requests: its first decode, then its fallbacks, in order (one input, one window at a time).
    windows: list[list[tuple[float, int, int]]] = []
    for rid, temperature, samples in requests:
        if temperature == 0.0 or not windows:
            windows.append([])
        windows[-1].append((temperature, samples, tokens[rid]))
    return windows


def describe(window: list[tuple[float, int, int]]) -> str:
    return " ".join(f"{t:.1f}x{n}:{k}" for t, n, k in window)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", default="1.3,1.5", help="lengths of the synthesized recordings besides long_meeting")
    ap.add_argument("--built", default="repeated_phrase,thanks_ten_times", help="tests/recordings.py's, '' for none")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        audios = build_long(0, Path(tmp))
        for minutes in filter(None, args.minutes.split(",")):
            (Path(tmp) / minutes).mkdir()
            audios += build_long(float(minutes), Path(tmp) / minutes)[1:]
        for name in filter(None, args.built.split(",")):
            import recordings

            path = Path(tmp) / f"{name}.wav"
            audios.append(Audio(path, recordings.spoken_text(name), write_wav(recordings.build(name), path)))
        totals = defaultdict(lambda: [0, 0, 0])  # system -> windows falling back, decodes past the first, tokens
        for audio in audios:
            runs = {"engine int8": engine_run(audio.path, args.threads),
                    "faster-whisper int8": faster_whisper_run(audio.path, args.threads)}
            print(f"\n{audio.path.name} ({audio.seconds:.0f} s): each window's decodes as temperature x samples:tokens")
            for name, windows in runs.items():
                fell = [w for w in windows if len(w) > 1]
                extra = sum(len(w) - 1 for w in windows)
                tokens = sum(k for w in windows for _, _, k in w)
                totals[name][0] += len(fell)
                totals[name][1] += extra
                totals[name][2] += tokens
                print(f"  {name}: {len(windows)} windows, {len(fell)} fall back ({extra} more decodes), "
                      f"{tokens} tokens decoded")
                for i, w in enumerate(windows):
                    if len(w) > 1:
                        print(f"    window {i}: {describe(w)}")
        print("\nin all:")
        for name, (fell, extra, tokens) in totals.items():
            print(f"  {name}: {fell} windows fall back, {extra} decodes past the first, {tokens} tokens decoded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
