"""Long bidirectional attention (Whisper's encoder) on the CPU: torch's flash kernel against oneDNN matmuls.

For each shape (heads x positions x head_dim, one sequence attending to itself, as an encoder layer
does), three ways, interleaved round by round so a busy moment of the machine hurts them alike:

    flash        F.scaled_dot_product_attention (the kernel torch picks on the CPU: flash attention,
                 whose block products go through MKL's sgemm)
    onednn fp32  attention/ops/onednn_attention.py: each head's keys as a oneDNN matmul weight
    onednn bf16  the same with bf16 operands (fp32 sums and softmax): what int8 engines take where
                 oneDNN has native bf16 (left out where it has not)

Each call reads another set of queries, keys and values than the call before it (--copies distinct
sets, cycled), so no call finds its operands in cache. Printed: the CPU model and flags, ms per call (best of
--rounds), each way's speed-up over flash, and each way's largest error against an fp64 reference
(flash and oneDNN fp32 should agree to ~1e-6; bf16 to ~1e-2).

    python scripts/bench_attention.py [--threads 2] [--rounds 5] [--shapes 12x1500x64,20x1500x64]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

DEFAULT_SHAPES = "12x1500x64,20x1500x64,6x1500x64,12x512x64,12x256x64"


def ways():
    import torch
    import torch.nn.functional as F

    from encdec_engine.attention.ops import onednn_attention
    from encdec_engine.layers.linear import bf16_native

    def flash(q, k, v):  # [L, H, D] token-major, as the engine holds them
        return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)).transpose(0, 1)

    def onednn(dtype):
        def run(q, k, v):
            out = torch.empty_like(q)
            onednn_attention.attend(q, k, v, q.shape[-1] ** -0.5, out, dtype)
            return out
        return run

    found = {"flash": flash, "onednn fp32": onednn(torch.float32)}
    if bf16_native():
        found["onednn bf16"] = onednn(torch.bfloat16)
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--copies", type=int, default=7, help="distinct operand sets per shape, cycled")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="heads x positions x head_dim, comma separated")
    args = ap.parse_args()

    import torch

    from bench_whisper import cpu_line
    from encdec_engine.machine.host_memory import keep_freed_memory

    keep_freed_memory()  # as the engine runs: a call's temporaries reuse the last call's pages
    torch.set_num_threads(args.threads)
    print(cpu_line())
    print(f"{args.threads} threads, best of {args.rounds} rounds, {args.copies} operand sets per shape")
    candidates = ways()
    names = list(candidates)
    print(f"{'shape':<14}" + "".join(f"{n + ' ms':>16}" for n in names)
          + "".join(f"{n + ' x':>14}" for n in names[1:]) + "".join(f"{n + ' err':>18}" for n in names))
    generator = torch.Generator().manual_seed(0)
    for shape in args.shapes.split(","):
        heads, length, head_dim = (int(x) for x in shape.lower().split("x"))
        sets = [tuple(torch.randn(length, heads, head_dim, generator=generator) for _ in range(3))
                for _ in range(args.copies)]
        q, k, v = (t.double() for t in sets[0])
        reference = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) * head_dim**-0.5, -1)
        reference = torch.einsum("hqk,khd->qhd", reference, v)
        errors = {n: (fn(*sets[0]).double() - reference).abs().max().item() for n, fn in candidates.items()}
        best = dict.fromkeys(names, float("inf"))
        for r in range(args.rounds):
            for i, n in enumerate(names if r % 2 == 0 else names[::-1]):
                operands = sets[(r * len(names) + i) % args.copies]  # never the set the call before read
                start = time.perf_counter()
                candidates[n](*operands)
                best[n] = min(best[n], time.perf_counter() - start)
        print(f"{shape:<14}" + "".join(f"{best[n] * 1e3:16.2f}" for n in names)
              + "".join(f"{best['flash'] / best[n]:14.2f}" for n in names[1:])
              + "".join(f"{errors[n]:18.1e}" for n in names))
    print("x: flash's time over the row's (above 1: faster than flash); err: largest |difference| from fp64")
    return 0


if __name__ == "__main__":
    sys.exit(main())
