"""One speech system, one benchmark job, in a process (and a venv) of its own.

`scripts/bench_whisper.py` runs this file once per system and workload, with the Python of the
venv that holds the system (peers are never installed in the project's venv):

    PYTHON scripts/bench_systems.py SYSTEM JOB.json OUT.json

JOB.json: {"workload": "clips" | "long", "audio": [16 kHz mono wav paths], "threads": N,
"repeats": N, "model": path, "options": {...}}. The model is loaded (timed as `load_s`), one
clip or the first 5 s is transcribed untimed (warm-up), then the workload runs `repeats` times:
"clips" transcribes every file in one call where the system can batch (else one after another),
"long" transcribes one recording sequentially, each system in its own long-form mode (timestamps,
temperature fallback, conditioning on the text so far, greedy). OUT.json gets `load_s`,
`seconds` (each repeat), `texts` and, where the system exposes them, text `tokens`.

Systems: engine (this project; options: quantization, kv_cache_dtype, chunked), hf (transformers
generate; options: batch_size), faster-whisper (options: compute_type, batched, batch_size),
whispercpp (pywhispercpp, a ggml file), openai-whisper (a .pt file). Only the engine and hf need
the project's venv; nothing here is imported by the package.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import soundfile as sf

SAMPLE_RATE = 16000
EOT = 50256  # tiny.en <|endoftext|>: every special token sits at or above it


def text_tokens(ids) -> list[int]:
    return [int(t) for t in ids if t < EOT]


def load(path: str) -> np.ndarray:
    audio, rate = sf.read(path, dtype="float32")
    if rate != SAMPLE_RATE or audio.ndim != 1:
        raise ValueError(f"{path}: expected 16 kHz mono, got {rate} Hz, shape {audio.shape}")
    return audio


# Each system: (job) -> (transcribe(audios) -> list[(text, tokens | None)]), loaded model inside.
def engine(job: dict):
    import torch

    from encdec_engine import LLM

    torch.set_num_threads(job["threads"])
    opts = job["options"]
    # Encoder-output reuse would skip the encoder for audio seen in the warm-up or a former repeat.
    llm = LLM(model=job["model"], quantization=opts.get("quantization"),
              kv_cache_dtype=opts.get("kv_cache_dtype", "auto"), enable_prefix_caching=False)
    exact = dict(timestamps=False, temperatures=(0.0,)) if job["workload"] == "clips" else {}
    if opts.get("chunked"):
        exact["chunked"] = True

    def run(audios):
        outs = llm.transcribe([(a, SAMPLE_RATE) for a in audios], language="en", **exact)
        for o in outs:
            if o.error:
                raise RuntimeError(o.error)
        return [(o.text.strip(), text_tokens([t for s in o.segments for t in s.tokens])) for o in outs]

    from encdec_engine.machine.cpu_kernels import machine_plan

    return run, machine_plan(int8=opts.get("quantization") == "int8").describe()


def hf(job: dict):
    import torch
    from transformers import AutoProcessor, WhisperForConditionalGeneration
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.set_num_threads(job["threads"])
    model = WhisperForConditionalGeneration.from_pretrained(job["model"], dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(job["model"])
    batch = job["options"].get("batch_size", 8)

    def run(audios):
        outs = []
        with torch.inference_mode():
            if job["workload"] == "clips":
                for i in range(0, len(audios), batch):
                    feats = processor(audios[i : i + batch], sampling_rate=SAMPLE_RATE, return_tensors="pt")
                    seqs = model.generate(input_features=feats.input_features)
                    outs += [(processor.decode(s, skip_special_tokens=True).strip(), text_tokens(s.tolist()))
                             for s in seqs]
                return outs
            for audio in audios:  # HF's sequential long-form: unpadded features, timestamps, fallback
                feats = processor(audio, sampling_rate=SAMPLE_RATE, return_tensors="pt", truncation=False,
                                  padding="longest", return_attention_mask=True)
                seq = model.generate(**feats, return_timestamps=True, condition_on_prev_tokens=True,
                                     temperature=(0.0, 0.2, 0.4, 0.6, 0.8, 1.0), logprob_threshold=-1.0,
                                     compression_ratio_threshold=2.4, no_speech_threshold=0.6)[0]
                outs.append((processor.decode(seq, skip_special_tokens=True).strip(), text_tokens(seq.tolist())))
        return outs

    return run, f"transformers, batch {batch}" if job["workload"] == "clips" else "transformers long-form"


def faster_whisper(job: dict):
    from faster_whisper import BatchedInferencePipeline, WhisperModel

    opts = job["options"]
    model = WhisperModel(job["model"], device="cpu", compute_type=opts["compute_type"], cpu_threads=job["threads"])
    if job["workload"] == "clips":  # greedy, no timestamps, no fallback: the engine's clip settings
        kw = dict(beam_size=1, temperature=0.0, without_timestamps=True, condition_on_previous_text=False)
    else:  # its long-form defaults, greedy
        kw = dict(beam_size=1)
    pipeline = BatchedInferencePipeline(model=model) if opts.get("batched") else None

    def run(audios):
        outs = []
        if pipeline is not None and job["workload"] == "clips":
            # The pipeline batches the chunks of ONE recording: the clips go end to end and
            # clip_timestamps cut them out again, one chunk per clip (no VAD).
            gap = np.zeros(SAMPLE_RATE // 10, dtype=np.float32)
            pieces, spans, offset = [], [], 0
            for a in audios:
                spans.append({"start": offset / SAMPLE_RATE, "end": (offset + len(a)) / SAMPLE_RATE})
                pieces += [a, gap]
                offset += len(a) + len(gap)
            segments, _ = pipeline.transcribe(np.concatenate(pieces), language="en", clip_timestamps=spans,
                                              batch_size=opts.get("batch_size", 16), **kw)
            by_clip = [[] for _ in audios]
            starts = np.array([s["start"] for s in spans])
            for s in segments:
                by_clip[int(np.abs(starts - s.start).argmin())].append(s)
            return [("".join(s.text for s in segs).strip(), text_tokens(t for s in segs for t in s.tokens))
                    for segs in by_clip]
        for a in audios:
            if pipeline is not None:  # one long file: its VAD cuts it into chunks decoded as a batch
                segments, _ = pipeline.transcribe(a, language="en", batch_size=opts.get("batch_size", 16), **kw)
            else:
                segments, _ = model.transcribe(a, language="en", **kw)
            segments = list(segments)  # a lazy generator: decoding happens here
            outs.append(("".join(s.text for s in segments).strip(), text_tokens(t for s in segments for t in s.tokens)))
        return outs

    return run, f"compute_type={opts['compute_type']}" + (" batched" if pipeline else "")


def whispercpp(job: dict):
    from pywhispercpp.model import Model

    kw = dict(n_threads=job["threads"], language="en", print_progress=False, print_realtime=False)
    if job["workload"] == "clips":  # greedy, no fallback, no timestamps
        kw.update(temperature=0.0, temperature_inc=0.0, no_timestamps=True)
    model = Model(job["model"], redirect_whispercpp_logs_to=None, **kw)

    def run(audios):  # one stream per context: clips go one after another
        return [(" ".join(s.text.strip() for s in model.transcribe(a)).strip(), None) for a in audios]

    return run, "whisper.cpp (pywhispercpp), ggml file"


def openai_whisper(job: dict):
    import torch
    import whisper

    torch.set_num_threads(job["threads"])
    model = whisper.load_model(job["model"], device="cpu")

    def run(audios):
        if job["workload"] == "clips":  # its batched decode of padded log-mels, greedy, no timestamps
            mels = torch.stack([whisper.log_mel_spectrogram(whisper.pad_or_trim(torch.from_numpy(a))) for a in audios])
            options = whisper.DecodingOptions(language="en", temperature=0.0, without_timestamps=True, fp16=False)
            return [(r.text.strip(), text_tokens(r.tokens)) for r in whisper.decode(model, mels, options)]
        outs = []
        for a in audios:
            r = model.transcribe(a, language="en", fp16=False)
            outs.append((r["text"].strip(), text_tokens(t for s in r["segments"] for t in s["tokens"])))
        return outs

    return run, "openai-whisper fp32"


SYSTEMS = {"engine": engine, "hf": hf, "faster-whisper": faster_whisper, "whispercpp": whispercpp,
           "openai-whisper": openai_whisper}


def main() -> int:
    system, job_file, out_file = sys.argv[1:4]
    job = json.loads(Path(job_file).read_text())
    audios = [load(p) for p in job["audio"]]
    start = time.perf_counter()
    run, info = SYSTEMS[system](job)
    load_s = time.perf_counter() - start
    run([audios[0][: 5 * SAMPLE_RATE]])  # warm-up: first-call allocations, thread pools, lazy imports
    seconds, outs = [], []
    for _ in range(job["repeats"]):
        start = time.perf_counter()
        outs = run(audios)
        seconds.append(time.perf_counter() - start)
    Path(out_file).write_text(json.dumps({"load_s": load_s, "seconds": seconds, "info": info,
                                          "texts": [t for t, _ in outs], "tokens": [k for _, k in outs]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
