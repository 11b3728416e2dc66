"""Whisper at the sizes users run (small, medium, large-v3-turbo): the engine against every CPU peer, one run.

Speed does not depend on the weights' values, so each size is a random-init checkpoint of its real
shape (models/configs/whisper.json; HF's own init, save_pretrained, tiny.en's tokenizer and its 51,864-id
vocabulary: the multilingual models have one or two ids more, at the same cost), converted
for the peers with their own tools: CTranslate2 (faster-whisper's engine) with `ct2-transformers-converter`
and whisper.cpp with the project's shared `hf_to_ggml.py` (f16, q8_0, q5_0). Each system runs in a
process of its own, the systems take turns for --rounds rounds, the best round counts; 2 threads.
Every window is a distinct 30 s of real speech (prefix caching off as well: no encoder output is
ever reused), the log-mel is computed in the timed part, and every decode makes exactly --tokens
tokens (end of text suppressed on every side):

    window      the encoder forward of one 30 s window with the prompt and the first token
    step b1     one batch-1 decode step (the slope between --tokens-low and --tokens new tokens)
    step b8     one decode step of 8 sequences together (whisper.cpp decodes one stream: none); left out
                where the 88 steps add less than a tenth to the 8 windows' time (turbo: the encoders'
                run-to-run noise is as large as the steps)
    e2e b1      1 window and --tokens tokens, end to end
    e2e b8      8 windows and --tokens tokens each, end to end (whisper.cpp: one after another)

Printed: the CPU model and flags, the engine's kernel choice, each size's table, each engine row's
ratio to CTranslate2 at the same precision (above 1: the engine is faster) and to whisper.cpp's
fastest quantized file, the engine's int8 over fp32, and the tokens int8 agrees with fp32 on.

    python scripts/bench_sizes.py --fw-python PEER/fw/bin/python --whispercpp-python PEER/wcpp/bin/python \\
        --ggml-converter PATH/hf_to_ggml.py [--sizes small,large-v3-turbo,medium] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench_step import run_worker

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
RECORDINGS = [ROOT / "prompts" / "audio" / "long_meeting.flac"]
WINDOW = 16000 * 30
SOT, NO_TIMESTAMPS, EOT = 50257, 50362, 50256  # tiny.en's vocabulary (the tokenizer at hand offline)
BATCH = 8


# -- the checkpoints ---------------------------------------------------------------------------------
def make_checkpoint(size: str) -> Path:
    """models/bench-whisper-<size>: random-init weights of the size's shape, tiny.en's tokenizer files."""
    dst = MODELS / f"bench-whisper-{size}"
    if (dst / "model.safetensors").exists() or (dst / "model.safetensors.index.json").exists():
        return dst
    import torch
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    from encdec_engine.checkpoints.ct2.importer import default_model_path

    entry = json.loads((MODELS / "configs" / "whisper.json").read_text())[size]
    torch.manual_seed(entry["seed"])
    model = WhisperForConditionalGeneration(WhisperConfig(**entry["config"])).eval()
    model.save_pretrained(dst)
    src = default_model_path()
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "vocab", "merges", "special", "added", "normalizer", "preprocessor")):
            shutil.copy(f, dst / f.name)
    gc = GenerationConfig.from_pretrained(src)
    gc.suppress_tokens, gc.begin_suppress_tokens = [], []
    gc.save_pretrained(dst)
    if entry["config"]["num_mel_bins"] != 80:  # the feature extractor's mel bins follow the model's
        pre = json.loads((dst / "preprocessor_config.json").read_text())
        pre["feature_size"] = entry["config"]["num_mel_bins"]
        (dst / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    return dst


def convert_ct2(hf: Path) -> Path:
    out = hf.with_name(hf.name + "-ct2")
    if not (out / "model.bin").exists():
        converter = Path(sys.executable).with_name("ct2-transformers-converter")
        subprocess.run([str(converter), "--model", str(hf), "--output_dir", str(out), "--copy_files",
                        "tokenizer.json", "preprocessor_config.json", "--force"], check=True, capture_output=True)
    return out


def convert_ggml(hf: Path, python: str, converter: str, dtype: str) -> Path:
    out = hf.with_name(f"{hf.name}-{dtype}.bin")
    if not out.exists():
        subprocess.run([python, converter, str(hf), str(out), "--dtype", dtype], check=True, capture_output=True)
    return out


# -- the workers (one process each) ---------------------------------------------------------------------
def windows(n: int) -> list:
    """n distinct 30 s windows of real speech (16 kHz float32), cycling through the recordings."""
    import numpy as np
    import soundfile as sf

    audio = np.concatenate([sf.read(str(p), dtype="float32")[0] for p in RECORDINGS])
    if audio.ndim == 2:
        audio = audio.mean(axis=1)
    step = max(1, (len(audio) - WINDOW) // max(1, n))
    out = []
    for i in range(n):
        start = (i * step) % max(1, len(audio) - WINDOW)
        out.append(np.ascontiguousarray(audio[start:start + WINDOW] * (1.0 - 0.01 * i)))  # distinct inputs
    return out


def engine_worker(args) -> dict:
    import torch

    from encdec_engine import LLM, SamplingParams
    from encdec_engine.machine.cpu_kernels import machine_plan

    torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, quantization=args.quantization, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
              enable_prefix_caching=False, kv_cache_space_gb=4.0)
    audio = windows(2 * BATCH + 2)
    counter = iter(range(10**9))

    def generate(batch: int, tokens: int) -> list[list[int]]:
        pick = [audio[next(counter) % len(audio)] for _ in range(batch)]
        prompts = [{"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": (a, 16000)}},
                    "decoder_prompt": {"prompt_token_ids": [SOT, NO_TIMESTAMPS]}} for a in pick]
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    result = measure(generate, args)
    result["kernels"] = machine_plan(int8=args.quantization == "int8").describe()
    return result


def ct2_worker(args) -> dict:
    import ctranslate2
    import numpy as np
    from faster_whisper.feature_extractor import FeatureExtractor

    model = ctranslate2.models.Whisper(args.model, device="cpu", compute_type=args.compute_type,
                                       intra_threads=args.threads, inter_threads=1)
    extractor = FeatureExtractor(feature_size=model.n_mels)
    audio = windows(2 * BATCH + 2)
    counter = iter(range(10**9))

    def generate(batch: int, tokens: int) -> list[list[int]]:
        pick = [audio[next(counter) % len(audio)] for _ in range(batch)]
        features = np.stack([extractor(a)[:, :3000] for a in pick])
        # CTranslate2 makes up to max_length // 2 tokens past the prompt (Whisper's sample_len)
        out = model.generate(ctranslate2.StorageView.from_array(np.ascontiguousarray(features)),
                             [[SOT, NO_TIMESTAMPS]] * batch, max_length=2 * tokens, beam_size=1,
                             suppress_tokens=[EOT], suppress_blank=False)
        seqs = [r.sequences_ids[0] for r in out]
        if any(len(s) != tokens for s in seqs):
            raise RuntimeError(f"CTranslate2 made {[len(s) for s in seqs]} tokens, asked for {tokens}")
        return seqs

    return measure(generate, args)


def whispercpp_worker(args) -> dict:
    import _pywhispercpp as w

    params = w.whisper_context_default_params()
    ctx = w.whisper_init_from_file_with_params(args.model, params)
    audio = windows(2 * BATCH + 2)
    counter = iter(range(10**9))

    def generate(batch: int, tokens: int) -> list[list[int]]:
        # One stream per context: windows one after another. The log-mel, the encoder, the prompt, then
        # `tokens` - 1 single-token decode calls (the token fed back is fixed: sampling is not timed here).
        for _ in range(batch):
            a = audio[next(counter) % len(audio)]
            assert w.whisper_pcm_to_mel(ctx, a, len(a), args.threads) == 0
            assert w.whisper_encode(ctx, 0, args.threads) == 0
            assert w.whisper_decode(ctx, SOT, 1, 0, args.threads) == 0
            assert w.whisper_decode(ctx, NO_TIMESTAMPS, 1, 1, args.threads) == 0
            for i in range(tokens - 1):
                assert w.whisper_decode(ctx, 220, 1, 2 + i, args.threads) == 0
        return []

    return measure(generate, args, batches=(1,))


def measure(generate, args, batches=(1, BATCH)) -> dict:
    """Best-of-repeats times: the window, the decode step per batch size, end to end per batch size."""
    generate(1, 2)  # warm-up: first-call allocations, lazy imports

    def best(batch: int, tokens: int) -> tuple[float, list[list[int]]]:
        times, out = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            out = generate(batch, tokens)
            times.append(time.perf_counter() - start)
        return min(times), out

    result: dict = {"window_ms": 1e3 * best(1, 1)[0]}
    for batch in batches:
        low, _ = best(batch, args.tokens_low)
        high, tokens = best(batch, args.tokens)
        if high - low > 0.1 * low:  # else the windows' own run-to-run noise is as large as the steps: no slope
            result[f"step_b{batch}_ms"] = 1e3 * (high - low) / (args.tokens - args.tokens_low)
        result[f"e2e_b{batch}_s"] = high
        if batch == 1:
            result["tokens"] = tokens
    return result


# -- the run -------------------------------------------------------------------------------------------
def systems(size: str, args) -> dict[str, tuple[str, list[str]]]:
    hf = make_checkpoint(size)
    rows = {"engine fp32": (sys.executable, ["--worker", "engine", "--model", str(hf)]),
            "engine int8": (sys.executable, ["--worker", "engine", "--model", str(hf), "--quantization", "int8"])}
    if args.bf16:
        rows["engine bf16"] = (sys.executable, ["--worker", "engine", "--model", str(hf), "--dtype", "bfloat16"])
        rows["engine int8_bfloat16"] = (sys.executable, ["--worker", "engine", "--model", str(hf), "--quantization",
                                                         "int8", "--dtype", "bfloat16"])
    if args.kv_int8:
        rows["engine int8 + int8 KV"] = (sys.executable, ["--worker", "engine", "--model", str(hf), "--quantization",
                                                          "int8", "--kv-cache-dtype", "int8"])
    if args.fw_python:
        ct2 = convert_ct2(hf)
        for compute in ("float32", "int8"):
            rows[f"CTranslate2 {compute}"] = (args.fw_python, ["--worker", "ct2", "--model", str(ct2),
                                                               "--compute-type", compute])
    if args.whispercpp_python and args.ggml_converter:
        for dtype in ("q8_0", "q5_0"):
            ggml = convert_ggml(hf, args.whispercpp_python, args.ggml_converter, dtype)
            rows[f"whisper.cpp {dtype}"] = (args.whispercpp_python, ["--worker", "whispercpp", "--model", str(ggml)])
    return rows


def report(size: str, results: dict[str, dict], args) -> None:
    print(f"\n{size}: {args.tokens} tokens per window (end of text suppressed), {args.threads} threads, best of "
          f"{args.rounds} rounds x {args.repeats} repeats")
    cols = ("window_ms", "step_b1_ms", f"step_b{BATCH}_ms", "e2e_b1_s", f"e2e_b{BATCH}_s")
    print(f"{'system':<26}{'window ms':>11}{'step b1 ms':>12}{'step b8 ms':>12}{'e2e b1 s':>10}{'e2e b8 s':>10}")
    for name, r in results.items():
        cells = "".join(f"{r[c]:{w}.{2 if c.endswith('_s') else 1}f}" if c in r else f"{'-':>{w}}"
                        for c, w in zip(cols, (11, 12, 12, 10, 10)))
        print(f"{name:<26}{cells}")
    cpp = [r for name, r in results.items() if name.startswith("whisper.cpp")]
    for name, r in results.items():
        if not name.startswith("engine"):
            continue
        peer = results.get("CTranslate2 int8" if "int8" in name else "CTranslate2 float32")
        if peer:
            ratios = ", ".join(f"{c.removesuffix('_ms').removesuffix('_s')} {peer[c] / r[c]:.2f}x" for c in cols
                               if c in r and c in peer)
            print(f"{name} vs {'CTranslate2 int8' if 'int8' in name else 'CTranslate2 float32'}: {ratios}")
        if cpp:
            fastest = min(cpp, key=lambda x: x["e2e_b1_s"])
            print(f"{name} vs whisper.cpp's fastest file: e2e b1 {fastest['e2e_b1_s'] / r['e2e_b1_s']:.2f}x, "
                  f"e2e b8 {fastest['e2e_b1_s'] * BATCH / r[f'e2e_b{BATCH}_s']:.2f}x")
    fp32, bf16 = results.get("engine fp32"), results.get("engine bf16")
    if fp32 and bf16:
        print(f"engine bf16 over fp32: e2e b1 {fp32['e2e_b1_s'] / bf16['e2e_b1_s']:.2f}x, e2e b8 "
              f"{fp32[f'e2e_b{BATCH}_s'] / bf16[f'e2e_b{BATCH}_s']:.2f}x")
    for batch in (1, BATCH):
        column = f"e2e_b{batch}_s"
        engines = {n: r[column] for n, r in results.items() if n.startswith("engine") and column in r}
        peers = {n: r[column] for n, r in results.items() if n.startswith("CTranslate2") and column in r}
        if engines and peers:
            (engine, mine), (peer, theirs) = min(engines.items(), key=lambda x: x[1]), min(peers.items(),
                                                                                          key=lambda x: x[1])
            print(f"fastest at batch {batch}: {engine} {mine:.2f} s against {peer} {theirs:.2f} s: {theirs / mine:.2f}x")
    fp32, int8 = results.get("engine fp32"), results.get("engine int8")
    if fp32 and int8:
        same = sum(a == b for a, b in zip(fp32["tokens"][0], int8["tokens"][0]))
        print(f"engine int8 over fp32: e2e b1 {fp32['e2e_b1_s'] / int8['e2e_b1_s']:.2f}x, e2e b8 "
              f"{fp32[f'e2e_b{BATCH}_s'] / int8[f'e2e_b{BATCH}_s']:.2f}x; int8 tokens equal to fp32's: "
              f"{same}/{len(fp32['tokens'][0])} (random weights: flat logits, near-ties flip)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="small,large-v3-turbo", help="of small, medium, large-v3-turbo")
    ap.add_argument("--fw-python", help="python of a venv with faster-whisper (CTranslate2 rows)")
    ap.add_argument("--whispercpp-python", help="python of a venv with pywhispercpp (whisper.cpp rows)")
    ap.add_argument("--ggml-converter", help="hf_to_ggml.py (the project's shared peers folder)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--tokens-low", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--bf16", action="store_true",
                    help="also the engine in bfloat16 and in int8_bfloat16 (a bf16 encoder, int8 decoder linears)")
    ap.add_argument("--kv-int8", action="store_true", help="also the engine with int8 weights and an int8 KV cache")
    ap.add_argument("--worker", choices=["engine", "ct2", "whispercpp"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--quantization", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--kv-cache-dtype", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--compute-type", default="int8", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker = {"engine": engine_worker, "ct2": ct2_worker, "whispercpp": whispercpp_worker}[args.worker]
        print(json.dumps(worker(args)))
        return 0

    from bench_whisper import cpu_line

    print(cpu_line())
    for size in args.sizes.split(","):
        rows = systems(size, args)
        results: dict[str, dict] = {}
        for _ in range(args.rounds):
            for name, (python, options) in rows.items():
                r = run_worker(python, options, args, script=__file__)
                best = results.setdefault(name, r)
                for key, value in r.items():
                    if key.endswith(("_ms", "_s")) and value < best[key]:
                        best[key] = value
        for name, r in results.items():
            if "kernels" in r:
                print(f"{name}: {r['kernels']}")
        report(size, results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
