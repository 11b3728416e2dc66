"""Long-form with VAD: the engine vs faster-whisper's BatchedInferencePipeline on one long recording.

Workload: a recording of --minutes (default 10) minutes built at run time, deterministic: English
sentences synthesized with espeak-ng (7 voices and speeds) and the bundled clips, with pauses of
1-8 s between them, and every ninth pause 30 or 60 s long, each pause filled in turn with silence,
white noise (10 dB below the speech), babble (30 dB below) or a music-like tone (6 dB below),
the fillers of tests/vad_audio.py. The reference is the spoken text. Every system gets the same
16 kHz array, tiny.en weights (the bundled CTranslate2 model, the engine's import of it), 2
threads, English, greedy (--beam-size 1: BatchedInferencePipeline.transcribe's own default is beam 5,
so it is passed to every system), no timestamps (the pipeline's default), and finds the speech itself
(Silero VAD; its time is in the row's):

    engine vad            LLM.transcribe(vad_filter=True, chunked=True): speech chunks of at most
                          30 s (faster-whisper's batched VAD defaults), decoded at once, with the
                          engine's default temperature fallback
    engine vad int8       the same on int8 weights (quantization="int8")
    engine vad t0         the same with temperatures=(0.0,): no fallback, the pipeline's decoding
                          (BatchedInferencePipeline uses the first temperature only)
    engine no-vad         LLM.transcribe(chunked=True): cut at quiet points, every window decoded,
                          what the engine does with the pauses when nothing removes them
    engine vad seq        (--sequential) LLM.transcribe(vad_filter=True): the speech joined, windows
                          one after another, each conditioned on the text before
    fw batched fp32/int8  BatchedInferencePipeline.transcribe(vad_filter=True, batch_size=N) on
                          WhisperModel(compute_type="float32" / "int8", cpu_threads=2)

With --recordings N, N recordings (seeds 0..N-1: other pauses, other voices for the sentences) are
transcribed and the WER is over all their words: a few words decoded apart on one recording (the
engine decodes as HF transformers does, CTranslate2 rounds differently, and tiny.en has near-ties)
weigh less. Each system transcribes one untimed 40 s warm-up recording first; model loading is not timed.
The engine runs with enable_prefix_caching=False (no encoder-output reuse across passes). Rows give
wall seconds (best of --repeats, round-robin), audio seconds per wall second, corpus WER (lowercased,
punctuation stripped), words produced, wall time relative to "engine vad" (fw / engine: above 1 the
engine is faster) and the 1-minute load average after the row (well above the threads: the time is
inflated by other work on the machine).

    python scripts/bench_vad.py [--minutes 10] [--recordings 1] [--fw-batch-size 8] [--repeats 1]
                                [--sequential] [--save-audio out.wav]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # vad_audio: the fillers and clips the VAD tests use

from bench_whisper import SAMPLE_RATE, SENTENCES, VOICES, cpu_line, normalize  # noqa: E402
from vad_audio import CLIPS, TRANSCRIPTS, babble, clip, silence, tone, white_noise  # noqa: E402

PAUSE_SECONDS = (1.0, 8.0)  # a pause between utterances lasts this long (uniform), except the long ones
LONG_PAUSES = (30.0, 60.0)  # every ninth pause, in turn
FILLERS = ("silence", "white", "babble", "tone")  # what fills each pause, in turn

# A system transcribes one recording into its text.
Transcribe = Callable[[np.ndarray], str]


@dataclass(frozen=True)
class LongRecording:
    samples: np.ndarray  # [num_samples] float32 at 16 kHz
    text: str  # what is spoken, in order
    speech_seconds: float  # seconds of utterances (pauses excluded)

    @property
    def seconds(self) -> float:
        return len(self.samples) / SAMPLE_RATE


def synthesize(text: str, voice: str, speed: int, tmp: Path) -> np.ndarray:
    from encdec_engine.inputs.audio import load_audio

    path = tmp / "utterance.wav"
    subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-w", str(path), text], check=True, capture_output=True)
    return load_audio(path)  # espeak writes 22.05 kHz; resampled


def filler(kind: str, seconds: float, seed: int) -> np.ndarray:
    return {"silence": lambda: silence(seconds), "white": lambda: white_noise(seconds, seed=seed),
            "babble": lambda: babble(seconds, seed=seed), "tone": lambda: tone(seconds, seed=seed)}[kind]()


def build_recording(minutes: float, seed: int = 0) -> LongRecording:
    """Utterances (synthesized sentences, then the bundled clips, in turn) and filled pauses until
    the recording is `minutes` long. The seed draws the pauses and shifts the sentences' voices."""
    rng = np.random.default_rng(seed)
    target = round(minutes * 60 * SAMPLE_RATE)
    pieces, texts, speech, n = [], [], 0, 0
    utterances: dict[int, tuple[np.ndarray, str]] = {}  # synthesized once per (sentence, voice)
    with tempfile.TemporaryDirectory() as tmp:
        while sum(len(p) for p in pieces) < target:
            k = n % (len(SENTENCES) + len(CLIPS))
            if k < len(SENTENCES):
                key = k * len(VOICES) + (n // len(SENTENCES) + seed) % len(VOICES)  # each seed its own voices
                if key not in utterances:
                    voice, speed = VOICES[key % len(VOICES)]
                    utterances[key] = synthesize(SENTENCES[k], voice, speed, Path(tmp)), SENTENCES[k]
                samples, text = utterances[key]
            else:
                name = CLIPS[k - len(SENTENCES)]
                samples, text = clip(name), TRANSCRIPTS[name]
            pause = LONG_PAUSES[(n // 9) % len(LONG_PAUSES)] if n % 9 == 8 else float(rng.uniform(*PAUSE_SECONDS))
            pieces += [samples, filler(FILLERS[n % len(FILLERS)], pause, seed=n)]
            texts.append(text)
            speech += len(samples)
            n += 1
    return LongRecording(np.concatenate(pieces).astype(np.float32), " ".join(texts), speech / SAMPLE_RATE)


def engine_systems(threads: int, sequential: bool, beam_size: int) -> list[tuple[str, Transcribe]]:
    from encdec_engine import LLM
    from encdec_engine.checkpoints.ct2.importer import default_model_path

    torch.set_num_threads(threads)
    llms = {q: LLM(model=str(default_model_path()), quantization=q, enable_prefix_caching=False)
            for q in (None, "int8")}

    def system(quantization: str | None = None, **options) -> Transcribe:
        def transcribe(samples: np.ndarray) -> str:
            out = llms[quantization].transcribe((samples, SAMPLE_RATE), language="en", timestamps=False,
                                                beam_size=beam_size, use_tqdm=False, **options)[0]
            if out.error:
                raise RuntimeError(f"engine failed: {out.error}")
            return out.text.strip()

        return transcribe

    vad = dict(vad_filter=True, chunked=True)
    systems = [("engine vad", system(**vad)), ("engine vad int8", system("int8", **vad)),
               ("engine vad t0", system(temperatures=(0.0,), **vad)), ("engine no-vad", system(chunked=True))]
    if sequential:
        systems.append(("engine vad seq", system(vad_filter=True)))
    return systems


def faster_whisper_system(compute_type: str, threads: int, batch_size: int, beam_size: int) -> Transcribe:
    from encdec_engine.checkpoints.ct2.bundled import bundled_model_dir
    from faster_whisper import BatchedInferencePipeline, WhisperModel

    ct2 = bundled_model_dir()
    pipeline = BatchedInferencePipeline(WhisperModel(str(ct2), device="cpu", compute_type=compute_type,
                                                     cpu_threads=threads))

    def transcribe(samples: np.ndarray) -> str:
        segments, _ = pipeline.transcribe(samples, language="en", vad_filter=True, batch_size=batch_size,
                                          without_timestamps=True, beam_size=beam_size)
        return "".join(s.text for s in segments).strip()  # the generator decodes as it is read

    return transcribe


def measure(systems: list[tuple[str, Transcribe]], recs: list[LongRecording], repeats: int) -> dict[str, tuple]:
    """(wall seconds summed over the recordings, each the best of `repeats` round-robin passes; the texts;
    the highest load average) per system."""
    results = {}
    for name, _ in systems:
        results[name] = ([float("inf")] * len(recs), [""] * len(recs), 0.0)
    for _ in range(repeats):
        for k, rec in enumerate(recs):
            for name, transcribe in systems:
                start = time.perf_counter()
                text = transcribe(rec.samples)
                seconds = time.perf_counter() - start
                best, texts, load = results[name]
                best[k], texts[k] = min(best[k], seconds), text
                results[name] = (best, texts, max(load, os.getloadavg()[0]))
    return {name: (sum(best), texts, load) for name, (best, texts, load) in results.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="length of each recording")
    ap.add_argument("--recordings", type=int, default=1, help="recordings (seeds 0, 1, ...): more words, a steadier WER")
    ap.add_argument("--fw-batch-size", type=int, default=8, help="BatchedInferencePipeline batch_size (its default)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--beam-size", type=int, default=1,
                    help="every system's beam size (1: greedy; the pipeline's own default is 5)")
    ap.add_argument("--repeats", type=int, default=1, help="timed passes per system; the best is reported")
    ap.add_argument("--sequential", action="store_true", help="add the engine's sequential VAD long-form row")
    ap.add_argument("--save-audio", default=None, help="also write the recording here (wav)")
    args = ap.parse_args()

    recs = [build_recording(args.minutes, seed=seed) for seed in range(args.recordings)]
    warmup = build_recording(40 / 60, seed=1000)
    for seed, rec in enumerate(recs):
        print(f"recording {seed}: {rec.seconds:.1f} s, {rec.speech_seconds:.1f} s of it speech, "
              f"{len(rec.text.split())} words")
    print(f"{args.threads} threads, torch {torch.__version__}; {cpu_line()}")
    if args.save_audio:
        import soundfile

        soundfile.write(args.save_audio, recs[0].samples, SAMPLE_RATE)
    systems = engine_systems(args.threads, args.sequential, args.beam_size)
    from encdec_engine.machine.cpu_kernels import machine_plan

    print(f"engine kernels: {machine_plan(int8=False).describe()}; {machine_plan(int8=True).describe()}")
    for compute_type in ("float32", "int8"):
        systems.append((f"fw batched {compute_type}", faster_whisper_system(compute_type, args.threads,
                                                                            args.fw_batch_size, args.beam_size)))
    for _, transcribe in systems:
        transcribe(warmup.samples)
    results = measure(systems, recs, args.repeats)

    audio_seconds = sum(rec.seconds for rec in recs)
    refs = [rec.text for rec in recs]
    engine_seconds = results["engine vad"][0]
    per_rec = " ".join(f"{'WER ' + str(k):>7}" for k in range(len(recs))) if len(recs) > 1 else ""
    print(f"\n{'system':<20} {'wall s':>8} {'audio s/s':>10} {'WER':>7} {'words':>6} {'vs engine':>10} {'load':>6} "
          f"{per_rec}")
    for name, (seconds, texts, load) in results.items():
        words = sum(len(normalize(t).split()) for t in texts)
        each = " ".join(f"{corpus_wer_of([r], [t]):7.2%}" for r, t in zip(refs, texts)) if len(recs) > 1 else ""
        print(f"{name:<20} {seconds:8.2f} {audio_seconds / seconds:10.1f} {corpus_wer_of(refs, texts):7.2%} "
              f"{words:6d} {seconds / engine_seconds:10.2f} {load:6.2f} {each}")
    print("\n'vs engine': the row's wall time over engine vad's (above 1: the engine is faster); WER: over all the "
          "recordings' words, then per recording")
    return 0


def corpus_wer_of(references: list[str], hypotheses: list[str]) -> float:
    import jiwer

    return jiwer.wer([normalize(r) for r in references], [normalize(h) for h in hypotheses])


if __name__ == "__main__":
    sys.exit(main())
