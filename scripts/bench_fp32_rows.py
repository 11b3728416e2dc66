"""fp32 decode rows: MKL `F.linear` against oneDNN's packed weights, alone and inside the decode step.

The fp32 linear kernel is chosen per machine (`machine/cpu_kernels.py`), not per weight shape.
This script is the measurement behind that: timed alone, MKL takes one tiny.en decode row through
a 384-wide layer in about half oneDNN's time, which suggests routing decode rows to MKL per
shape. Inside the decode step it does not hold, so the per-machine choice stays. It prints:

    alone     each decoder weight shape of tiny.en at 1 and 8 rows, both kernels, warm (the same
              call repeated, as a load-time calibration would time it) and cold (the caches
              flushed before each call by a pass over 64 MB, as in a step that streams the head,
              the cross caches and every layer's weights)
    in situ   two engines in this process on the same weights: every fp32 linear on oneDNN, and
              every linear on MKL (only the decoder's run in the steps timed) with the head
              still on oneDNN; rounds alternate between
              them, each round the per-step slope of greedy generate between --tokens-low and
              --tokens new tokens (first 30 s of long_meeting, end of text banned); the tokens
              of the two are compared

    python scripts/bench_fp32_rows.py [--rounds 8] [--tokens 105] [--tokens-low 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import engine_generator, same_tokens  # noqa: E402
from bench_whisper import cpu_line  # noqa: E402

SHAPES = ((1152, 384), (384, 384), (768, 384), (1536, 384), (384, 1536))  # tiny.en's [out, in] linears


def median_us(fn, reps: int, flush: torch.Tensor | None = None) -> float:
    fn()
    times = []
    for _ in range(reps):
        if flush is not None:
            flush.add_(1.0)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def alone() -> None:
    from encdec_engine.layers.linear import PackedWeight

    flush = torch.zeros(16 << 20)  # 64 MB, twice the L3 of the machines this was measured on
    print(f"{'weight [out, in]':<18}{'rows':>5}{'MKL warm':>10}{'oneDNN warm':>13}{'MKL cold':>10}{'oneDNN cold':>13}  (us)")
    for out_features, in_features in SHAPES:
        weight, bias = torch.randn(out_features, in_features), torch.randn(out_features)
        packed = PackedWeight(weight, bias)
        for rows in (1, 8):
            x = torch.randn(rows, in_features)
            mkl, onednn = (lambda: F.linear(x, weight, bias)), (lambda: packed(x))
            cells = [median_us(mkl, 200), median_us(onednn, 200), median_us(mkl, 40, flush), median_us(onednn, 40, flush)]
            print(f"{f'{out_features} x {in_features}':<18}{rows:>5}" + "".join(f"{c:>11.0f}" for c in cells))


def engine(kernel: str):
    from encdec_engine import LLM
    from encdec_engine.machine import cpu_kernels
    from encdec_engine.layers.linear import PackedWeight
    from encdec_engine.checkpoints.ct2.importer import default_model_path

    os.environ["ENCDEC_CPU_LINEAR"] = kernel
    cpu_kernels.machine_plan.cache_clear()
    llm = LLM(model=str(default_model_path()), num_kv_blocks=256)  # prefix caching: one encoder pass
    llm.engine.model.vocab_projection.use(PackedWeight)  # the head on oneDNN in both
    return llm


def in_situ(args) -> None:
    engines = {"oneDNN": engine("onednn"), "MKL decoder": engine("mkl")}
    generators = {name: engine_generator(llm) for name, llm in engines.items()}

    def generate(name: str, tokens: int) -> tuple[float, list[int]]:
        start = time.perf_counter()
        out = generators[name](tokens)
        return time.perf_counter() - start, out

    steps: dict[str, list[float]] = {name: [] for name in engines}
    tokens = {name: generate(name, args.tokens)[1] for name in engines}  # warm-up
    for _ in range(args.rounds):
        for name in engines:
            low, high = generate(name, args.tokens_low)[0], generate(name, args.tokens)[0]
            steps[name].append((high - low) / (args.tokens - args.tokens_low) * 1e3)
    base = statistics.median(steps["oneDNN"])
    for name, times in steps.items():
        print(f"{name:<14} step median {statistics.median(times):.2f} ms (min {min(times):.2f}), "
              f"{base / statistics.median(times):.2f}x oneDNN's")
    a, b = tokens.values()
    print(f"tokens equal at their position: {same_tokens(a, b)} of {len(a)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=105)
    parser.add_argument("--tokens-low", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_line())
    print(f"{args.threads} threads, fp32, tiny.en")
    alone()
    in_situ(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
