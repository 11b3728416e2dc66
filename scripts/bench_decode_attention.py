"""Decode attention on the CPU: the compiled kernel reading the paged pool against the head-major copies.

One decode step's attention reads (one query per sequence and head) through the torch backend three ways,
interleaved round by round:

    kernel   attention/ops/cpu_decode.py: straight from the pool's blocks (fp32, an fp32 model's pool)
    bf16     the kernel over a bf16 pool of the same values (a bf16 model's pool): half the bytes
    copies   the backend without it: cross contexts from head-major copies (`HeadMajorContexts`), self
             contexts from per-sequence rows (`SelfRows`), both in attention/backends/cpu_copies.py;
             the copies are made before the timing starts, so only their reads are timed

Each case has as many layers (pools) as a model of its shape, read in turn as a step reads them, so no
read finds the one before it in cache; a self case's contexts grow by a key each round, as decode
steps grow them (the copies' rows append it). Every value is a bf16 value (held exactly by the
fp32 pool). Printed: the CPU model and flags, ms per layer (best of --rounds), the kernel's speed-up over
the copies and the bf16 pool's over the fp32 one, the fp32 kernel's bytes of K/V read per second, the
largest difference between the kernel's and the copies' outputs, and whether the bf16 pool's equal the
fp32 pool's to the bit.

    python scripts/bench_decode_attention.py [--threads 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# name -> (sequences, heads, head_dim, layers, self (causal) or cross, context lengths of sequence i of n)
CASES = {
    "bart-base cross, 256 seqs, 16..256 keys": (256, 12, 64, 6, False, lambda i, n: 16 + i * 240 // max(n - 1, 1)),
    "bart-base self, 256 seqs at 8 keys": (256, 12, 64, 6, True, lambda i, n: 8),
    "bart-base self, 256 seqs at 33 keys": (256, 12, 64, 6, True, lambda i, n: 33),
    "bart-base self, 256 seqs at 64 keys": (256, 12, 64, 6, True, lambda i, n: 64),
    "t5-base self, 128 seqs at 40 keys": (128, 12, 64, 12, True, lambda i, n: 40),
    "whisper-small cross, 1 seq, 1500 keys": (1, 12, 64, 12, False, lambda i, n: 1500),
    "whisper-small self, 1 seq, 100 keys": (1, 12, 64, 12, True, lambda i, n: 100),
    "whisper-turbo cross, 8 seqs, 1500 keys": (8, 20, 64, 4, False, lambda i, n: 1500),
}
BLOCK_SIZE = 16


def build(case, steps: int, seed: int = 0):
    """Pools (one a layer), a function giving step r's decode view, and the queries of a case. A self
    case's contexts grow by a key a step (the copies' rows append it, as in the engine); a cross case's
    stay (its copies are read again)."""
    import numpy as np
    import torch

    from encdec_engine.attention.metadata import AttentionView
    from encdec_engine.worker.input_prep import pad_rows

    n, heads, dim, layers, causal, length = case
    lens = [length(i, n) for i in range(n)]
    room = [m + (steps if causal else 0) for m in lens]
    rng = np.random.default_rng(seed)
    num_blocks = sum(-(-m // BLOCK_SIZE) for m in room)
    order = rng.permutation(num_blocks) if causal else np.arange(num_blocks)  # self blocks scattered, cross runs
    tables, used = [], 0
    for m in room:
        tables.append(order[used : used + -(-m // BLOCK_SIZE)].tolist())
        used += len(tables[-1])
    pools = [torch.randn(2, num_blocks, BLOCK_SIZE, heads, dim).bfloat16().float() for _ in range(layers)]

    def view(step: int):
        keys = [m + step for m in lens] if causal else lens
        table = pad_rows(tables)
        last = np.array(keys) - 1  # a self step writes its new key and value first, at its last position
        slots = table[np.arange(n), last // BLOCK_SIZE] * BLOCK_SIZE + last % BLOCK_SIZE if causal else None
        view = AttentionView.from_arrays(np.arange(n + 1), keys, causal, block_tables=table, slot_mapping=slots)
        view.seq_ids = list(range(n)) if causal else None  # the rows the copies keep per sequence
        return view
    # the query, and a self step's new K/V
    queries = [torch.randn(3, n, heads, dim).bfloat16().float() for _ in range(layers)]
    return pools, view, queries, sum(lens) * heads * dim * 2 * 4


def way(kernel, pools, views):
    """A step's reads of every layer through a backend with or without the kernel."""
    from encdec_engine.attention.backends.torch_sdpa import TorchSDPABackend
    from encdec_engine.attention.metadata import AttentionMetadata

    backend = TorchSDPABackend(BLOCK_SIZE)
    backend.fused_decode = kernel
    backend.size_copies(4 * sum(p.numel() * 4 for p in pools))  # an engine's pool outgrows these contexts

    def step(r: int, queries):
        view = views(r)
        backend.plan(AttentionMetadata(decoder=view) if view.causal else AttentionMetadata(decoder=None, cross=view))
        new = (lambda kv: (kv[1], kv[2])) if view.causal else (lambda kv: (None, None))
        return [backend.forward(kv[0], *new(kv), pool, view, kv.shape[-1] ** -0.5) for kv, pool in zip(queries, pools)]
    return step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    import torch

    from bench_whisper import cpu_line
    from encdec_engine.attention.ops import cpu_decode

    torch.set_num_threads(args.threads)
    print(cpu_line())
    kernel = cpu_decode.load()
    if kernel is None:
        print("the kernel does not build here (the log says why): nothing to compare")
        return 1
    print(f"threads {args.threads}; kernel {kernel.path}")
    print(f"{'case':42s} {'kernel ms':>10s} {'bf16 ms':>8s} {'copies ms':>10s} {'speed-up':>9s} {'bf16 x':>7s} "
          f"{'kernel GB/s':>12s} {'max diff':>9s} {'bf16 same':>9s}")
    with torch.inference_mode():
        for name, case in CASES.items():
            pools, views, queries, nbytes = build(case, args.rounds + 1)
            steps = {"kernel": way(kernel, pools, views), "bf16": way(kernel, [p.bfloat16() for p in pools], views),
                     "copies": way(None, pools, views)}
            outs = {k: step(0, queries) for k, step in steps.items()}  # the copies made; the outputs compared
            diff = max((a - b).abs().max().item() for a, b in zip(outs["kernel"], outs["copies"]))
            same = all(torch.equal(a, b) for a, b in zip(outs["kernel"], outs["bf16"]))
            best = {k: float("inf") for k in steps}
            for r in range(1, args.rounds + 1):
                for k, step in steps.items():
                    t0 = time.perf_counter()
                    step(r, queries)
                    best[k] = min(best[k], (time.perf_counter() - t0) / len(pools))
            print(f"{name:42s} {best['kernel'] * 1e3:10.3f} {best['bf16'] * 1e3:8.3f} {best['copies'] * 1e3:10.3f} "
                  f"{best['copies'] / best['kernel']:8.2f}x {best['kernel'] / best['bf16']:6.2f}x "
                  f"{nbytes / best['kernel'] / 1e9:12.1f} {diff:9.1e} {'yes' if same else 'NO':>9s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
