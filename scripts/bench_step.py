"""One 30 s window and one batch-1 decode step: the engine beside faster-whisper's CTranslate2, one run.

The main job (one file, sequential long-form) costs an encoder forward per 30 s window and one
batch-1 decode step per token. This times both for each system, on the same tiny.en weights (the
bundled CTranslate2 model and the engine's import of it) and the same input (the first 30 s of
prompts/audio/long_meeting.flac as log-mel features, each system's own), greedy, 2 threads:

    window  encoder forward + the decoder prompt + the first token (generate with one new token)
    step    the slope of generate's time between --tokens-low and --tokens new tokens, end of text
            banned (engine: ignore_eos; CTranslate2: suppress_tokens=[eot])

For the engine rows it also prints where a step goes, from wall-clock timers around the parts
(taken as the same difference between the two lengths, per step):

    linears      the decoder layers' projections (int8 or fp32 kernels)
    cross reads  attention over each layer's 1,500-position cross cache
    self reads   attention over the tokens so far (the paged self cache)
    head         the 51,864-way vocab projection
    the rest     layer norms, embeddings, GELU, residual adds, KV stores, the sampler and logits
                 processors, input preparation, scheduling, outputs, and the Python between them

Each system runs in a process of its own, faster-whisper with the Python of its venv (nothing of
it is installed in the project's); the best of --repeats counts. The tokens of the longest run are
compared with faster-whisper's of the same compute type (tokens equal at their position).

    python scripts/bench_step.py --fw-python peer-venvs/fw/bin/python [--threads 2] \\
        [--tokens 101] [--tokens-low 1] [--repeats 5] [--kv-int8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AUDIO = ROOT / "prompts" / "audio" / "long_meeting.flac"
WINDOW_SAMPLES = 16000 * 30
EOT, SOT, NO_TIMESTAMPS = 50256, 50257, 50362  # tiny.en
PARTS = ("linears", "cross reads", "self reads", "head")


def ct2_worker(args) -> dict:
    """faster-whisper's CTranslate2 model (its venv: no torch, no engine)."""
    import ctranslate2
    import numpy as np
    import soundfile as sf
    from faster_whisper import WhisperModel

    model = WhisperModel(args.model, device="cpu", compute_type=args.compute_type, cpu_threads=args.threads)
    audio, _ = sf.read(str(AUDIO), dtype="float32")
    features = model.feature_extractor(audio[:WINDOW_SAMPLES])[:, :3000]
    features = ctranslate2.StorageView.from_array(np.ascontiguousarray(features[None]))

    def generate(new_tokens: int) -> list[int]:
        # CTranslate2 decodes up to max_length // 2 tokens past the prompt (Whisper's sample_len)
        out = model.model.generate(features, [[SOT, NO_TIMESTAMPS]], max_length=2 * new_tokens, beam_size=1,
                                   suppress_tokens=[EOT], suppress_blank=False)
        return out[0].sequences_ids[0]

    return measure(generate, args)


def engine_generator(llm) -> Callable[[int], list[int]]:
    """generate(new_tokens) -> the tokens `llm` decodes greedily for the first 30 s of long_meeting, end of
    text banned."""
    from encdec_engine import SamplingParams
    from encdec_engine.inputs.audio import load_audio
    from encdec_engine.inputs.features import log_mel_spectrogram

    features = log_mel_spectrogram([load_audio(AUDIO)[:WINDOW_SAMPLES]])[0]
    prompt = {"prompt": "", "multi_modal_data": {"input_features": features}}

    def generate(new_tokens: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        tokens = list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
        if len(tokens) != new_tokens:
            raise RuntimeError(f"generated {len(tokens)} tokens, asked for {new_tokens}")
        return tokens

    return generate


def engine_worker(args) -> dict:
    import torch

    from encdec_engine import LLM
    from encdec_engine.checkpoints.ct2.bundled import bundled_model_dir
    from encdec_engine.checkpoints.ct2.importer import default_model_path

    torch.set_num_threads(args.threads)
    llm = LLM(model=str(default_model_path()), quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
              enable_prefix_caching=False)  # the encoder output of a former pass would be reused
    generate = engine_generator(llm)
    result = measure(generate, args)
    with PartTimers() as timers:  # one more pass of each length, timed by parts
        generate(args.tokens_low)
        low = dict(timers.totals)
        generate(args.tokens)
        high = {k: v - low[k] for k, v in timers.totals.items()}
    steps = args.tokens - args.tokens_low
    result["parts_ms"] = {k: 1e3 * (high[k] - low[k]) / steps for k in PARTS}
    from encdec_engine.machine.cpu_kernels import machine_plan

    result["kernels"] = machine_plan(int8=args.quantization == "int8").describe()
    return result


class PartTimers:
    """Wall-clock totals of the step's parts, by wrapping the functions that do them (at class level)."""

    def __init__(self) -> None:
        self.totals = dict.fromkeys(PARTS, 0.0)
        self._saved = []

    def __enter__(self) -> PartTimers:
        from torch import nn

        from encdec_engine.attention.backends.torch_sdpa import TorchSDPABackend
        from encdec_engine.quantization.int8_weights import Int8Linear
        from encdec_engine.layers.linear import PackedLinear
        from encdec_engine.models.whisper import WhisperForConditionalGeneration

        def attention_part(args, kwargs) -> str:
            view = args[3] if len(args) > 3 else kwargs["view"]
            return "self reads" if view.causal else "cross reads"

        for owner, name, part in ((Int8Linear, "forward", "linears"), (PackedLinear, "forward", "linears"),
                                  (nn.Linear, "forward", "linears"),
                                  (WhisperForConditionalGeneration, "compute_logits", "head"),
                                  (TorchSDPABackend, "_attend_cache", attention_part)):
            fn = owner.__dict__[name]
            self._saved.append((owner, name, fn))
            setattr(owner, name, self._timed(fn, part))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, fn in self._saved:
            setattr(owner, name, fn)

    def _timed(self, fn, part):
        totals = self.totals

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[part if isinstance(part, str) else part(args, kwargs)] += time.perf_counter() - start

        return timed


def measure(generate, args) -> dict:
    """Best-of-repeats seconds of generate(low) and generate(high) -> window and per-step ms."""
    for _ in range(2):
        generate(args.tokens_low)  # warm-up: first-call allocations, lazy imports

    def best(new_tokens: int) -> tuple[float, list[int]]:
        times, tokens = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            tokens = generate(new_tokens)
            times.append(time.perf_counter() - start)
        return min(times), tokens

    low, low_tokens = best(args.tokens_low)
    high, tokens = best(args.tokens)
    if len(low_tokens) != args.tokens_low or len(tokens) != args.tokens:
        raise RuntimeError(f"generated {len(low_tokens)} and {len(tokens)} tokens, asked for "
                           f"{args.tokens_low} and {args.tokens}")
    return {"window_ms": 1e3 * low, "step_ms": 1e3 * (high - low) / (args.tokens - args.tokens_low),
            "tokens": tokens}


def run_worker(python: str, options: list[str], args, script: str = __file__) -> dict:
    """Run `script`'s worker mode in `python` (a process of its own) and return the JSON it prints last."""
    cmd = [python, script, "--threads", str(args.threads), "--tokens", str(args.tokens),
           "--tokens-low", str(args.tokens_low), "--repeats", str(args.repeats), *options]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(options)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def same_tokens(a: list[int], b: list[int]) -> int:
    return sum(x == y for x, y in zip(a, b))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fw-python", help="python of a venv with faster-whisper (no peer rows without it)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=101, help="new tokens of the long generate")
    ap.add_argument("--tokens-low", type=int, default=1, help="new tokens of the short generate (the window)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kv-int8", action="store_true", help="also the engine with int8 weights and an int8 KV cache")
    ap.add_argument("--worker", choices=["engine", "ct2"], help=argparse.SUPPRESS)
    ap.add_argument("--quantization", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--kv-cache-dtype", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--compute-type", default="int8", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tokens <= args.tokens_low or args.tokens_low < 1:
        ap.error("need 1 <= --tokens-low < --tokens")
    if args.worker:
        result = engine_worker(args) if args.worker == "engine" else ct2_worker(args)
        print(json.dumps(result))
        return 0

    from bench_whisper import cpu_line

    from encdec_engine.checkpoints.ct2.bundled import bundled_model_dir

    ct2_model = bundled_model_dir()

    rows: list[tuple[str, dict]] = []
    engines = [("engine fp32", []), ("engine int8", ["--quantization", "int8"])]
    if args.kv_int8:
        engines.append(("engine int8 + int8 KV", ["--quantization", "int8", "--kv-cache-dtype", "int8"]))
    for name, options in engines:
        rows.append((name, run_worker(sys.executable, ["--worker", "engine", *options], args)))
    if args.fw_python:
        for compute in ("float32", "int8"):
            rows.append((f"faster-whisper {compute}", run_worker(
                args.fw_python, ["--worker", "ct2", "--compute-type", compute, "--model", str(ct2_model)],
                args)))

    print(cpu_line())
    for name, r in rows:
        if "kernels" in r:
            print(f"{name}: {r['kernels']}")
    print(f"\nfirst 30 s of {AUDIO.name}, greedy, {args.threads} threads, best of {args.repeats}; "
          f"step = slope from {args.tokens_low} to {args.tokens} new tokens")
    result = dict(rows)
    fw = {"fp32": result.get("faster-whisper float32"), "int8": result.get("faster-whisper int8")}
    print(f"{'system':<24}{'window ms':>10}{'step ms':>9}{'same tokens':>13}   step split, ms: "
          + " / ".join(PARTS) + " / the rest")
    for name, r in rows:
        peer = fw["int8" if "int8" in name else "fp32"]
        same = "" if peer is None or name.startswith("faster") else f"{same_tokens(r['tokens'], peer['tokens'])}/{args.tokens}"
        line = f"{name:<24}{r['window_ms']:>10.1f}{r['step_ms']:>9.2f}{same:>13}"
        if "parts_ms" in r:
            parts = r["parts_ms"]
            rest = r["step_ms"] - sum(parts.values())
            line += "   " + " / ".join(f"{parts[p]:.2f}" for p in PARTS) + f" / {rest:.2f}"
        print(line)
    for compute, peer in fw.items():
        for name, r in rows:
            if peer is not None and name.startswith("engine") and (compute == "int8") == ("int8" in name):
                print(f"{name} vs faster-whisper {compute}: window {peer['window_ms'] / r['window_ms']:.2f}x, "
                      f"step {peer['step_ms'] / r['step_ms']:.2f}x (above 1: the engine is faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
