"""Throughput: the engine vs Hugging Face `generate` on the same workload, same run.

Workloads (random-init weights, greedy, exactly --max-tokens new tokens per request:
min_tokens = max_tokens):

    bart     --num-requests requests, encoder lengths uniform in --min-len..--max-len
             (random token ids); --size base (bart-base) or large (bart-large), built as the
             tests build random BART (wide init, random logits bias, positions and layer
             norms), so the outputs vary with the input and agreement figures mean
             something. HF gets right-padded encoder inputs with an attention mask.
    whisper  --num-requests 30 s log-mel windows (random features) with a 4-token
             decoder prompt; --size tiny (tiny.en shape) or large-v3 (1.55B params,
             128 mels). HF runs the plain `generate` loop (no Whisper-specific logits
             processors on either side) on batches of feature windows.

The engine runs once per --engine-variants (on the CPU by default fp32, int8 weights,
an int8 KV cache, and both; each compared with the fp32 engine token for token: outputs
equal, and the share of tokens equal at their position). HF runs at each of
--hf-batch-sizes; its outputs are compared with the fp32 engine's. The engine gets one
untimed warm-up request; model loading is not timed.

    python scripts/bench_throughput.py [--num-requests 64] [--hf-batch-sizes 1,8,32] [--profile]
    # on a CUDA machine (the GPU issue's workloads):
    python scripts/bench_throughput.py --device cuda --dtype bfloat16 --size large --num-requests 1000 \
        --hf-batch-sizes 32,128,256
    python scripts/bench_throughput.py --device cuda --dtype bfloat16 --workload whisper --size large-v3 \
        --num-requests 256 --hf-batch-sizes 16,64,128
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
MODEL_CONFIGS = ROOT / "models" / "configs"


def sizes(arch: str, names: tuple[str, ...]) -> dict[str, dict]:
    """The HF config kwargs of models/configs/<arch>.json's entries `names`."""
    entries = json.loads((MODEL_CONFIGS / f"{arch}.json").read_text())
    return {name: entries[name]["config"] for name in names}


BART_SIZES = sizes("bart", ("base", "large"))
WHISPER_SIZES = sizes("whisper", ("tiny", "large-v3"))
WHISPER_PROMPT = [50258, 50259, 50360, 50364]  # large-v3 ids of sot, en, transcribe, notimestamps (any 4 ids do)


def checkpoint(path: Path, workload: str = "bart", size: str = "base") -> Path:
    """A random-init checkpoint of the workload's model at `size`, made once."""
    if (path / "config.json").is_file():
        return path
    if workload == "bart":  # the test suite's builder: outputs that vary with the input, not one token repeated
        sys.path.insert(0, str(ROOT / "tests"))
        from helpers import make_bart

        return make_bart(path, size)
    torch.manual_seed(0)
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    sot, no_timestamps = WHISPER_PROMPT[0], WHISPER_PROMPT[-1]
    config = WhisperConfig(**dict(WHISPER_SIZES[size], decoder_start_token_id=sot, eos_token_id=sot - 1,
                                  pad_token_id=sot - 1, begin_suppress_tokens=None, suppress_tokens=None))
    WhisperForConditionalGeneration(config).save_pretrained(path)
    GenerationConfig(decoder_start_token_id=sot, eos_token_id=sot - 1, pad_token_id=sot - 1,
                     no_timestamps_token_id=no_timestamps).save_pretrained(path)
    return path


def workload(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[0] + rng.integers(4, 50000, size=int(rng.integers(lo, hi + 1)) - 2).tolist() + [2] for _ in range(n)]


def feature_windows(n: int, num_mel_bins: int, seed: int) -> torch.Tensor:
    """[n, mels, 3000] random log-mel windows in Whisper's normalized range."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(n, num_mel_bins, 3000, generator=gen) * 2.0 - 0.8).clamp(max=1.0)


def engine_prompts(workload_name: str, inputs) -> list:
    if workload_name == "bart":
        return [{"prompt_token_ids": p} for p in inputs]
    return [{"encoder_prompt": {"prompt_token_ids": [], "multi_modal_data": {"input_features": f}},
             "decoder_prompt": {"prompt_token_ids": WHISPER_PROMPT}} for f in inputs]


# --engine-variants: name -> LLM options
VARIANTS = {"fp32": {}, "int8": {"quantization": "int8"}, "kv8": {"kv_cache_dtype": "int8"},
            "int8+kv8": {"quantization": "int8", "kv_cache_dtype": "int8"}}


def run_engine(path: Path, prompts: list, max_tokens: int, device: str, dtype: str, profile: bool,
               enforce_eager: bool, **options):
    from encdec_engine import LLM, SamplingParams

    kv = {} if device.startswith("cuda") else {"kv_cache_space_gb": 4.0}  # CUDA: sized from free memory
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype=dtype, device=device, enforce_eager=enforce_eager,
              **kv, **options)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    sync(device)
    prof = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if prof:
        prof.enable()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync(device)
    if prof:
        prof.disable()
    elapsed = time.perf_counter() - start
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    stats = llm.engine.stats
    print(f"  engine steps: {stats['prefill_steps']} prefill, {stats['decode_steps']} decode "
          f"({llm.engine.runner.graph_steps} from CUDA graphs); {llm.engine.kv_pool.describe()}")
    tokens = [o.outputs[0].token_ids for o in outs]
    # Hand the KV pool back before HF runs: the first engine of a process can stay referenced
    # (torch's lazy imports keep frames alive) until a full collection.
    del llm, outs
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return tokens, elapsed


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def run_hf(workload_name: str, path: Path, inputs, max_tokens: int, batch_size: int, device: str, dtype: str):
    from transformers import BartForConditionalGeneration, WhisperForConditionalGeneration
    from transformers.generation import GenerationMixin

    torch_dtype = _DTYPES.get(dtype, torch.float32)
    cls = BartForConditionalGeneration if workload_name == "bart" else WhisperForConditionalGeneration
    model = cls.from_pretrained(path, dtype=torch_dtype).to(device).eval()
    greedy = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, num_beams=1,
                  forced_eos_token_id=None, forced_bos_token_id=None, no_repeat_ngram_size=0)
    outs = []
    sync(device)
    start = time.perf_counter()
    for i in range(0, len(inputs), batch_size):
        batch = inputs[i : i + batch_size]
        with torch.inference_mode():
            if workload_name == "bart":
                width = max(len(p) for p in batch)
                ids = torch.full((len(batch), width), 1, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for j, p in enumerate(batch):
                    ids[j, : len(p)] = torch.tensor(p)
                    mask[j, : len(p)] = 1
                prompt = [2, 0]
                gen = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                     decoder_input_ids=torch.tensor([prompt] * len(batch), device=device), **greedy)
            else:  # the generic loop: Whisper's own generate adds its timestamp and language logic
                prompt = WHISPER_PROMPT
                gen = GenerationMixin.generate(
                    model, input_features=batch.to(device, torch_dtype),
                    decoder_input_ids=torch.tensor([prompt] * len(batch), device=device), **greedy)
        outs.extend(row[len(prompt):].tolist() for row in gen.cpu())
    sync(device)
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
    ap.add_argument("--workload", choices=["bart", "whisper"], default="bart")
    ap.add_argument("--size", default=None, help="bart: base (default) | large; whisper: tiny (default) | large-v3")
    ap.add_argument("--checkpoint", default=None,
                    help="default: models/bart-<size> (as scripts/make_checkpoints.py makes it), "
                         "models/checkpoints/whisper-<size>-random")
    ap.add_argument("--enforce-eager", action="store_true", help="CUDA: decode without CUDA graphs")
    ap.add_argument("--profile", action="store_true", help="cProfile the engine run")
    ap.add_argument("--engine-variants", default=None,
                    help=f"comma-separated of {', '.join(VARIANTS)} (default: all on the CPU, fp32,kv8 on CUDA)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    sizes = BART_SIZES if args.workload == "bart" else WHISPER_SIZES
    size = args.size or next(iter(sizes))
    if size not in sizes:
        ap.error(f"--size for {args.workload} must be one of {', '.join(sizes)}")
    default = (ROOT / "models" / f"bart-{size}" if args.workload == "bart"
               else ROOT / "models" / "checkpoints" / f"whisper-{size}-random")
    path = checkpoint(Path(args.checkpoint or default), args.workload, size)
    if args.workload == "bart":
        inputs = workload(args.num_requests, args.min_len, args.max_len, seed=0)
        shape = (f"encoder lengths {args.min_len}..{args.max_len} (mean {np.mean([len(p) for p in inputs]):.0f})")
    else:
        inputs = feature_windows(args.num_requests, WHISPER_SIZES[size]["num_mel_bins"], seed=0)
        shape = "30 s feature windows (1500 encoder positions)"
    new_tokens = args.num_requests * args.max_tokens
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"{args.threads} CPU threads"
    print(f"workload: {args.workload}-{size}, {args.num_requests} requests, {shape}, {args.max_tokens} new tokens "
          f"each, {args.dtype}, {device_name}")
    if not args.device.startswith("cuda"):
        from bench_whisper import cpu_line

        print(cpu_line())

    variants = (args.engine_variants or ("fp32,kv8" if args.device.startswith("cuda") else ",".join(VARIANTS)))
    variants = [v for v in variants.split(",") if v]
    if "fp32" not in variants or any(v not in VARIANTS for v in variants):
        ap.error(f"--engine-variants must include fp32 and name only {', '.join(VARIANTS)}")
    outputs, rows = {}, []
    for variant in sorted(variants, key=lambda v: v != "fp32"):
        print(f"engine {variant}:")
        outputs[variant], secs = run_engine(path, engine_prompts(args.workload, inputs), args.max_tokens, args.device,
                                            args.dtype, args.profile, args.enforce_eager, **VARIANTS[variant])
        rows.append((f"engine {variant}" if variant != "fp32" else "engine", secs, outputs[variant]))
    for bs in [int(b) for b in args.hf_batch_sizes.split(",") if b]:
        hf_out, hf_s = run_hf(args.workload, path, inputs, args.max_tokens, bs, args.device, args.dtype)
        rows.append((f"hf generate bs={bs}", hf_s, hf_out))

    engine_s, reference = rows[0][1], outputs["fp32"]
    print(f"\n{'run':<22}{'seconds':>9}{'req/s':>9}{'tok/s':>9}  {'outputs equal to engine':>24}  tokens equal")
    for name, secs, out in rows:
        same = sum(a == b for a, b in zip(out, reference))
        tokens = sum(x == y for a, b in zip(out, reference) for x, y in zip(a, b)) / max(1, new_tokens)
        agree = "" if out is reference else f"{same}/{args.num_requests}"
        print(f"{name:<22}{secs:9.2f}{args.num_requests / secs:9.2f}{new_tokens / secs:9.1f}  {agree:>24}"
              f"  {'' if out is reference else f'{100 * tokens:.1f}%'}")
    best_hf = min((secs for name, secs, _ in rows if name.startswith("hf")), default=None)
    if best_hf is not None:
        print(f"\nengine (fp32) vs HF's best: {best_hf / engine_s:.2f}x")
    for name, secs, _ in rows[1:]:
        if name.startswith("engine"):
            print(f"{name} vs engine fp32: {engine_s / secs:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
