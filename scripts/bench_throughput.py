"""Throughput: the engine vs Hugging Face `generate` on the same BART workload, same run.

Default workload: 64 requests, encoder lengths uniform in 64..512 (random token
ids), exactly 64 generated tokens each (min_tokens = max_tokens), bart-base-sized
random weights, fp32, 2 threads. HF runs at batch sizes 1, 8 and 32 (right-padded
encoder inputs with an attention mask). Outputs are compared token for token.

    python scripts/bench_throughput.py [--num-requests 64] [--hf-batch-sizes 1,8,32] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
BART_BASE = dict(vocab_size=50265, d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                 decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072,
                 max_position_embeddings=1024, forced_eos_token_id=None, dropout=0.0)


def checkpoint(path: Path) -> Path:
    """A bart-base-sized random-init checkpoint, made once."""
    if (path / "config.json").is_file():
        return path
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    BartForConditionalGeneration(BartConfig(**BART_BASE)).save_pretrained(path)
    return path


def workload(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[0] + rng.integers(4, 50000, size=int(rng.integers(lo, hi + 1)) - 2).tolist() + [2] for _ in range(n)]


def run_engine(path: Path, prompts, max_tokens: int, device: str, dtype: str, profile: bool):
    from encdec_engine import LLM, SamplingParams

    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype=dtype, device=device, kv_cache_space_gb=4.0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)
    llm.generate([{"prompt_token_ids": prompts[0][:64]}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    prof = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if prof:
        prof.enable()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if prof:
        prof.disable()
    elapsed = time.perf_counter() - start
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    stats = llm.engine.stats
    print(f"  engine steps: {stats['prefill_steps']} prefill, {stats['decode_steps']} decode")
    return [o.outputs[0].token_ids for o in outs], elapsed


def run_hf(path: Path, prompts, max_tokens: int, batch_size: int, device: str, dtype: str):
    from transformers import BartForConditionalGeneration

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "auto": torch.float32}[dtype]
    model = BartForConditionalGeneration.from_pretrained(path, dtype=torch_dtype).to(device).eval()
    outs = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), 1, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, p in enumerate(batch):
            ids[j, : len(p)] = torch.tensor(p)
            mask[j, : len(p)] = 1
        with torch.inference_mode():
            gen = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device),
                decoder_input_ids=torch.tensor([[2, 0]] * len(batch), device=device),
                max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, num_beams=1,
                forced_eos_token_id=None, forced_bos_token_id=None, no_repeat_ngram_size=0, min_length=0,
            )
        outs.extend(row[2:].tolist() for row in gen.cpu())
    return outs, time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--hf-batch-sizes", default="1,8,32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--checkpoint", default=str(ROOT / "models" / "checkpoints" / "bart-base-random"))
    ap.add_argument("--profile", action="store_true", help="cProfile the engine run")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    path = checkpoint(Path(args.checkpoint))
    prompts = workload(args.num_requests, args.min_len, args.max_len, seed=0)
    new_tokens = args.num_requests * args.max_tokens
    print(f"workload: {args.num_requests} requests, encoder lengths {args.min_len}..{args.max_len} "
          f"(mean {np.mean([len(p) for p in prompts]):.0f}), {args.max_tokens} new tokens each, "
          f"{args.dtype}, {args.threads} threads, {args.device}")

    engine_out, engine_s = run_engine(path, prompts, args.max_tokens, args.device, args.dtype, args.profile)
    rows = [("engine", engine_s, None)]
    for bs in [int(b) for b in args.hf_batch_sizes.split(",") if b]:
        hf_out, hf_s = run_hf(path, prompts, args.max_tokens, bs, args.device, args.dtype)
        same = sum(a == b for a, b in zip(engine_out, hf_out))
        rows.append((f"hf generate bs={bs}", hf_s, same))

    best_hf = min((s for name, s, _ in rows[1:]), default=None)
    print(f"\n{'run':<22}{'seconds':>9}{'req/s':>9}{'tok/s':>9}  outputs equal to engine")
    for name, secs, same in rows:
        agree = "" if same is None else f"{same}/{args.num_requests}"
        print(f"{name:<22}{secs:9.2f}{args.num_requests / secs:9.2f}{new_tokens / secs:9.1f}  {agree}")
    if best_hf is not None:
        print(f"\nengine vs HF's best: {best_hf / engine_s:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
