"""Encoder-output reuse: one document, many decoder prompts, caching on vs off (same run).

bart-base-sized random weights, fp32, 2 threads: an encoder input of `--doc-len`
tokens with `--num-prompts` different decoder prompts. With caching on, the
encoder runs once and every request shares its cross blocks.

    python scripts/bench_prefix_cache.py [--doc-len 512] [--num-prompts 8] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_throughput import ROOT, checkpoint  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc-len", type=int, default=512)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="batches of the same document (cache stays warm)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--checkpoint", default=str(ROOT / "models" / "checkpoints" / "bart-base-random"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from encdec_engine import LLM, SamplingParams

    path = checkpoint(Path(args.checkpoint))
    rng = np.random.default_rng(0)
    doc = [0] + rng.integers(4, 50000, size=args.doc_len - 2).tolist() + [2]
    prompts = [{"encoder_prompt": {"prompt_token_ids": doc},
                "decoder_prompt": {"prompt_token_ids": [2, 0] + rng.integers(4, 50000, size=4).tolist()}}
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, min_tokens=args.max_tokens)
    results = {}
    for caching in (False, True):
        llm = LLM(model=str(path), skip_tokenizer_init=True, enable_prefix_caching=caching)
        llm.generate([{"prompt_token_ids": [0, 5, 6, 2]}], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        runs = llm.engine.stats["encoder_runs"]
        start = time.perf_counter()
        outs = [llm.generate(prompts, params, use_tqdm=False) for _ in range(args.rounds)]
        elapsed = time.perf_counter() - start
        results[caching] = ([o.outputs[0].token_ids for batch in outs for o in batch], elapsed,
                            llm.engine.stats["encoder_runs"] - runs, dict(llm.engine.block_manager.cache_stats))
    (off, t_off, runs_off, _), (on, t_on, runs_on, stats) = results[False], results[True]
    n = args.rounds * args.num_prompts
    print(f"{n} requests: one {args.doc_len}-token document x {args.num_prompts} decoder prompts x {args.rounds} rounds,"
          f" {args.max_tokens} new tokens each")
    print(f"caching off: {t_off:7.2f} s  encoder runs {runs_off}")
    print(f"caching on:  {t_on:7.2f} s  encoder runs {runs_on}  cache stats {stats}")
    print(f"speed-up {t_off / t_on:.2f}x, outputs identical: {on == off}")
    return 0 if on == off else 1


if __name__ == "__main__":
    sys.exit(main())
