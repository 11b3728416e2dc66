"""Where the time of the main job goes: one long file, sequential long-form, greedy, batch 1.

Transcribes `prompts/audio/long_meeting.flac` (69 s, three 30 s windows decoded one after
another) once to warm up, then once with a timer around each part, and prints the time per decode step split
into what the engine does around the matmuls:

    encoder            the encoder forward of each window (amortized over the steps)
    decoder forward    the decoder layers of a step (linears, attention, norms)
    logits             the vocab projection (51,864 x 384 for tiny.en)
    sampler            logits processors (Whisper's timestamp rules, suppression) and sampling
    input prep         host arrays, attention metadata and the backend's per-step plan
    scheduler          scheduling, block manager, stop checks, detokenization, outputs
    transcription      the window loop: log-mel, prompts, segments, seeking

then a torch.profiler table of the ops of a few decode steps (self CPU time). The timer is
CPU time of this process (`--clock cpu`, the default) or wall time: on a machine that other
jobs share, CPU time with one thread is the steadier split.

    python scripts/profile_main_job.py [--quantization int8] [--kv-cache-dtype int8] [--threads 1]
"""

from __future__ import annotations

import argparse
import functools
import inspect
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
AUDIO = ROOT / "prompts" / "audio" / "long_meeting.flac"

def categories() -> dict[str, list]:
    """category -> the functions whose cumulative time it is (none nested in another category's)."""
    from encdec_engine.attention.backends.torch_sdpa import TorchSDPABackend
    from encdec_engine.engine.llm_engine import LLMEngine
    from encdec_engine.layers.sampler import Sampler
    from encdec_engine.llm import LLM
    from encdec_engine.models.whisper import WhisperForConditionalGeneration as Whisper
    from encdec_engine.worker.model_runner import ModelRunner

    return {
        "encoder": [Whisper.encode],
        "decoder forward": [Whisper.forward],
        "logits": [Whisper.compute_logits],
        "sampler": [Sampler.__call__],
        "input prep": [ModelRunner.decode_batch, ModelRunner.prepare_decode, ModelRunner.prepare_prefill,
                       ModelRunner._sampling_row, TorchSDPABackend.plan],
        "engine step": [LLMEngine.step],
        "all": [LLM.transcribe],
    }


class StepTimers:
    """Wraps each category's functions (at class level) in a timer: far less overhead than cProfile,
    which would inflate the Python-heavy parts."""

    def __init__(self, clock) -> None:
        self.clock, self.totals, self._saved = clock, {}, []

    def __enter__(self) -> StepTimers:
        for category, functions in categories().items():
            self.totals[category] = 0.0
            for fn in functions:
                owner = _owner(fn)
                raw = inspect.getattr_static(owner, fn.__name__)  # a staticmethod stays one
                self._saved.append((owner, fn.__name__, raw))
                timed = self._timed(category, fn)
                setattr(owner, fn.__name__, staticmethod(timed) if isinstance(raw, staticmethod) else timed)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, fn in self._saved:
            setattr(owner, name, fn)

    def _timed(self, category: str, fn):
        clock, totals = self.clock, self.totals
        depth = {"n": 0}  # a function that calls itself (or a sibling of its category) counts once

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            depth["n"] += 1
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                depth["n"] -= 1
                if depth["n"] == 0:
                    totals[category] += clock() - start

        return timed


def _owner(fn):
    module = sys.modules[fn.__module__]
    return getattr(module, fn.__qualname__.split(".")[0])


def split(totals: dict[str, float], steps: int) -> dict[str, float]:
    """ms per decode step of each category (the windows' prefills are spread over the steps)."""
    parts = {k: totals[k] for k in ("encoder", "decoder forward", "logits", "sampler", "input prep")}
    # what is left of a step: scheduler, block manager, stop checks, detokenization, outputs
    parts["scheduler"] = totals["engine step"] - sum(parts.values())
    parts["transcription"] = totals["all"] - totals["engine step"]
    parts["total"] = totals["all"]
    return {k: 1e3 * v / steps for k, v in parts.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", default=None, choices=[None, "int8"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", default="cpu", choices=["cpu", "wall"])
    ap.add_argument("--ops", type=int, default=25, help="rows of the torch.profiler table (0: none)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from encdec_engine import LLM
    from encdec_engine.inputs.audio import load_audio
    from encdec_engine.checkpoints.ct2.importer import default_model_path

    llm = LLM(model=str(default_model_path()), quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
              enable_prefix_caching=False)
    audio = load_audio(AUDIO)
    llm.transcribe([audio])  # warm-up: first-call allocations, lazy imports
    before = dict(llm.engine.stats)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    with StepTimers(clock) as timers:
        start = clock()
        llm.transcribe([audio])
        seconds = clock() - start
    steps = llm.engine.stats["decode_steps"] - before["decode_steps"]
    prefills = llm.engine.stats["prefill_steps"] - before["prefill_steps"]
    print(f"long_meeting.flac: {prefills} windows, {steps} decode steps, {seconds:.2f} s {args.clock} "
          f"{args.threads} thread(s), quantization={args.quantization}, "
          f"kv_cache_dtype={args.kv_cache_dtype}")
    per_step = split(timers.totals, steps)
    total = per_step.pop("total")
    print(f"per decode step: {total:.2f} ms")
    for name, ms in per_step.items():
        print(f"  {name:<16}{ms:7.2f} ms  {100 * ms / total:5.1f}%")

    if args.ops:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            llm.transcribe([audio[: 16000 * 25]])
        print(f"\ntorch.profiler, the first 25 s as one window (prefill + its decode steps), "
              f"top {args.ops} ops by self CPU:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.ops))
    return 0


if __name__ == "__main__":
    sys.exit(main())
