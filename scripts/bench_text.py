"""Text-family throughput against CTranslate2 and HF generate, in one run, interleaved.

    python scripts/bench_text.py                  # marian-base, t5-base, bart-base shaped; fp32 and int8
    python scripts/bench_text.py --quick          # tiny shapes, 8 requests: proves the script runs
    python scripts/bench_text.py --models t5 --precisions int8 --rounds 3

For each model shape a random-init checkpoint (unit-gain random weights, so that outputs depend on
the input) is saved with `save_pretrained` (with a word-level tokenizer of the model's
vocabulary size, which the CTranslate2 converter reads) under --workdir, and
converted with `ct2-transformers-converter` (fp32, and `--quantization int8`). The workload: --requests
sources of random token ids, lengths spread evenly over [--min-len, --max-len], each decoded greedily for
exactly --new-tokens tokens (EOS suppressed until then on every side: min_tokens, min_decoding_length,
min_new_tokens), from the decoder start token alone. Every system gets --threads CPU threads: the
engine (`threads`, int8 = `quantization="int8"`), CTranslate2 (`intra_threads`, `compute_type`, batches
of --ct2-batch-size sorted by length), and HF `generate` in fp32 at the best of --hf-batch-sizes
(probed on the first --hf-probe requests; batches sorted by length, padded). Systems alternate within
each round; the table reports each system's best round, the ratios (targets: 1.3x CTranslate2 at the
same precision, 3x HF) and how many outputs equal the engine's, token for token.

Every timed run is a process of its own (this script's --worker mode: load, warm up, time one run,
print the outputs as JSON). In one process the systems slow each other: with a CTranslate2 translator
loaded beside it, the engine's Marian-base fp32 run took 31.8 s against 19.6 s alone (Zen 5, 2 threads;
both OpenMP pools wait on the same two cores).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # name -> (HF config class, model class, models/configs file, entry, quick entry)
    "marian": ("MarianConfig", "MarianMTModel", "marian", "base", "small"),
    "t5": ("T5Config", "T5ForConditionalGeneration", "t5", "base", "small"),
    "bart": ("BartConfig", "BartForConditionalGeneration", "bart", "base", "small"),
}
QUICK_VOCAB = 512


def cpu_description() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")),
                 platform.processor())
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    simd = [f for f in flags if f.startswith(("avx", "fma", "amx", "sse4", "f16c", "vnni")) or "vnni" in f]
    return (f"CPU: {model}; torch capability {torch.backends.cpu.get_cpu_capability()}\n"
            f"CPU flags (SIMD): {' '.join(sorted(simd))}")


def special_tokens(arch: str) -> dict[str, int]:
    """Where each family's special tokens sit (BART: fairseq's; T5: <pad> first; Marian: <pad> last)."""
    return {"bart": {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}, "t5": {"<pad>": 0, "</s>": 1, "<unk>": 2},
            "marian": {"</s>": 0, "<unk>": 1}}[arch]


def write_tokenizer(dst: Path, arch: str, vocab_size: int) -> dict:
    """A word-level tokenizer with exactly vocab_size tokens in the family's layout; returns its ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = special_tokens(arch)
    vocab = dict(specials)
    last = vocab_size - 1 if arch == "marian" else vocab_size
    for i in range(len(vocab), last):
        vocab[f"w{i}"] = i
    if arch == "marian":
        vocab["<pad>"] = vocab_size - 1
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>", pad_token="<pad>",
                                  bos_token="<s>" if arch == "bart" else None)
    tok.save_pretrained(dst)
    return {"pad": vocab["<pad>"], "eos": vocab["</s>"], "bos": vocab.get("<s>"), "specials": set(vocab) & {
        "<s>", "<pad>", "</s>", "<unk>"}, "vocab": vocab}


def make_checkpoint(dst: Path, arch: str, quick: bool) -> dict:
    import transformers

    config_name, model_name, configs, entry, quick_entry = SHAPES[arch]
    spec = json.loads((ROOT / "models" / "configs" / f"{configs}.json").read_text())[quick_entry if quick else entry]
    kwargs = dict(spec["config"])
    if quick:
        kwargs["vocab_size"] = QUICK_VOCAB
    ids = write_tokenizer(dst, arch, kwargs["vocab_size"])
    if arch == "marian":
        kwargs.update(pad_token_id=ids["pad"], eos_token_id=ids["eos"], decoder_start_token_id=ids["pad"])
    elif arch == "t5":
        kwargs.update(pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    kwargs.pop("init_std", None)
    torch.manual_seed(spec["seed"])
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**kwargs)).eval()
    with torch.no_grad():
        # Unit-gain random weights: with HF's init (std 0.02) a random model ignores its encoder and every
        # request decodes to the same tokens, and every agreement figure would be trivially whole.
        d = model.config.d_model
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
            elif "relative_attention_bias" in name or ("embed_positions" in name and arch == "bart"):
                param.normal_(0.0, 1.0)
            elif name.endswith("shared.weight") or "embed_tokens" in name or "lm_head" in name:
                param.normal_(0.0, 1.0 if arch == "t5" else d**-0.5)  # T5 scales its output by d**-0.5
            elif param.dim() == 2:  # linears: std 1/sqrt(fan_in)
                param.normal_(0.0, param.shape[1] ** -0.5)
        if getattr(model, "final_logits_bias", None) is not None:
            model.final_logits_bias.normal_(0.0, 0.3)
        if arch == "marian":  # the decoder starts from <pad>, whose embedding is zero (CTranslate2 relies on
            model.model.shared.weight[ids["pad"]] = 0  # it) and which is never generated (HF: bad_words_ids)
            model.final_logits_bias[0, ids["pad"]] = -1e4
    model.save_pretrained(dst)
    if arch == "bart":  # CTranslate2's converter still reads this field, which transformers 5 no longer writes
        config = json.loads((dst / "config.json").read_text())
        config["normalize_before"] = False
        (dst / "config.json").write_text(json.dumps(config, indent=2))
    return ids


def convert(src: Path, dst: Path, quantization: str | None) -> None:
    converter = Path(sys.executable).with_name("ct2-transformers-converter")
    cmd = [str(converter if converter.exists() else "ct2-transformers-converter"), "--model", str(src),
           "--output_dir", str(dst), "--force"]
    if quantization:
        cmd += ["--quantization", quantization]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def workload(n: int, low: int, high: int, vocab_size: int, ids: dict, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [low + round(i * (high - low) / max(1, n - 1)) for i in range(n)]
    rng.shuffle(lengths)
    specials = {ids["vocab"][t] for t in ids["specials"]}
    words = [i for i in range(vocab_size) if i not in specials]
    return [[rng.choice(words) for _ in range(length - 1)] + [ids["eos"]] for length in lengths]


def run_engine(path: Path, sources, new_tokens: int, threads: int, int8: bool, start: int):
    from encdec_engine import LLM, SamplingParams

    llm = LLM(model=str(path), threads=threads, quantization="int8" if int8 else None, enable_prefix_caching=False,
              skip_tokenizer_init=True, max_num_seqs=256)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens)
    prompts = [{"encoder_prompt": {"prompt_token_ids": s}, "decoder_prompt": {"prompt_token_ids": [start]}}
               for s in sources]
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up

    def run():
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return run


def run_ct2(path: Path, sources, new_tokens: int, threads: int, int8: bool, vocab: dict, batch: int):
    import ctranslate2

    translator = ctranslate2.Translator(str(path), device="cpu", compute_type="int8" if int8 else "float32",
                                        inter_threads=1, intra_threads=threads)
    names = {i: t for t, i in vocab.items()}
    tokens = [[names[i] for i in s] for s in sources]
    options = dict(beam_size=1, max_decoding_length=new_tokens, min_decoding_length=new_tokens, max_batch_size=batch,
                   batch_type="examples")
    translator.translate_batch(tokens[:4], **options)  # warm-up

    def run():
        results = translator.translate_batch(tokens, **options)
        return [[vocab[t] for t in r.hypotheses[0]] for r in results]
    return run


def run_hf(path: Path, sources, new_tokens: int, threads: int, batch: int, pad: int, start: int):
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(path).eval()
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))

    def run():
        out: list = [None] * len(sources)
        for b in range(0, len(order), batch):
            rows = order[b: b + batch]
            width = max(len(sources[i]) for i in rows)
            ids = torch.full((len(rows), width), pad)
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            for r, i in enumerate(rows):  # right padding, as tokenizers pad encoder inputs
                ids[r, : len(sources[i])], mask[r, : len(sources[i])] = torch.tensor(sources[i]), 1
            with torch.no_grad():
                gen = model.generate(input_ids=ids, attention_mask=mask, decoder_input_ids=torch.full(
                    (len(rows), 1), start), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                    num_beams=1, forced_bos_token_id=None, forced_eos_token_id=None, bad_words_ids=None)
            for r, i in enumerate(rows):
                out[i] = gen[r, 1:].tolist()
        return out
    return run


def timed(run) -> tuple[float, list]:
    t0 = time.perf_counter()
    outputs = run()
    return time.perf_counter() - t0, outputs


def worker(args) -> dict:
    """One system's timed run in this process (--worker): {"seconds", "outputs"}, or for --worker hf-probe
    the best HF batch size on the first --hf-probe requests: {"batch"}."""
    folder = Path(args.folder)
    vocab, config, ids, start, sources = load_workload(folder, args)
    torch.set_num_threads(args.threads)
    if args.worker == "hf-probe":
        sizes = [int(s) for s in args.hf_batch_sizes.split(",")]
        times = {size: timed(run_hf(folder, sources[: args.hf_probe], args.new_tokens, args.threads, size,
                                    vocab["<pad>"], start))[0] for size in sizes}
        return {"batch": min(times, key=times.get)}
    int8 = args.precision == "int8"
    if args.worker == "engine":
        run = run_engine(folder, sources, args.new_tokens, args.threads, int8, start)
    elif args.worker == "ct2":
        run = run_ct2(Path(args.ct2_dir), sources, args.new_tokens, args.threads, int8, vocab, args.ct2_batch_size)
    else:
        run = run_hf(folder, sources, args.new_tokens, args.threads, args.hf_batch, vocab["<pad>"], start)
    seconds, outputs = timed(run)
    return {"seconds": seconds, "outputs": outputs}


def load_workload(folder: Path, args):
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    config = json.loads((folder / "config.json").read_text())
    ids = {"eos": vocab["</s>"], "vocab": vocab, "specials": {"<s>", "<pad>", "</s>", "<unk>"} & set(vocab)}
    sources = workload(args.requests, args.min_len, args.max_len, config["vocab_size"], ids)
    return vocab, config, ids, config["decoder_start_token_id"], sources


def run_worker(args, *options: str) -> dict:
    """This script's --worker mode in a process of its own, with the workload's arguments; its JSON."""
    cmd = [sys.executable, __file__, "--requests", str(args.requests), "--min-len", str(args.min_len),
           "--max-len", str(args.max_len), "--new-tokens", str(args.new_tokens), "--threads", str(args.threads),
           "--ct2-batch-size", str(args.ct2_batch_size), "--hf-batch-sizes", args.hf_batch_sizes,
           "--hf-probe", str(args.hf_probe), *options]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(options)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> str:
    same = sum(a == b for a, b in zip(outputs, reference))
    return f"{same}/{len(reference)}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes and workload: check the script runs")
    p.add_argument("--models", default="marian,t5,bart")
    p.add_argument("--precisions", default="fp32,int8")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds; each system's best is reported")
    p.add_argument("--ct2-batch-size", type=int, default=32)
    p.add_argument("--hf-batch-sizes", default="8,16,32")
    p.add_argument("--hf-probe", type=int, default=32, help="requests the HF batch sizes are probed on")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--workdir", default=str(ROOT / "models" / "bench-text"))
    p.add_argument("--worker", choices=["engine", "ct2", "hf", "hf-probe"], help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    p.add_argument("--ct2-dir", help=argparse.SUPPRESS)
    p.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    p.add_argument("--hf-batch", type=int, default=8, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.requests, args.min_len, args.max_len, args.new_tokens, args.rounds = 8, 8, 32, 8, 1
        args.hf_batch_sizes, args.hf_probe = "4,8", 8
    if args.worker:
        print(json.dumps(worker(args)))
        return
    print(cpu_description())
    import ctranslate2
    import transformers
    print(f"torch {torch.__version__}, ctranslate2 {ctranslate2.__version__}, transformers {transformers.__version__}; "
          f"{args.threads} threads; {args.requests} requests, sources {args.min_len}..{args.max_len} tokens, "
          f"{args.new_tokens} new tokens each (EOS suppressed), greedy; every run a process of its own\n")
    work = Path(args.workdir) / ("quick" if args.quick else "base")
    rows = []
    for arch in args.models.split(","):
        folder = work / arch
        if not (folder / "config.json").exists():
            shutil.rmtree(folder, ignore_errors=True)
            make_checkpoint(folder, arch, args.quick)
        generated = args.requests * args.new_tokens
        hf_batch = None if args.no_hf else run_worker(args, "--worker", "hf-probe", "--folder", str(folder))["batch"]
        for precision in args.precisions.split(","):
            int8 = precision == "int8"
            ct2_dir = work / f"{arch}-ct2-{precision}"
            if not (ct2_dir / "model.bin").exists():
                convert(folder, ct2_dir, "int8" if int8 else None)
            common = ("--folder", str(folder), "--precision", precision)
            systems = {"engine": ("--worker", "engine", *common),
                       "ctranslate2": ("--worker", "ct2", "--ct2-dir", str(ct2_dir), *common)}
            if hf_batch is not None and not int8:
                systems[f"hf (batch {hf_batch})"] = ("--worker", "hf", "--hf-batch", str(hf_batch), *common)
            best_s: dict[str, float] = {}
            outputs: dict[str, list] = {}
            for _ in range(args.rounds):  # interleaved: every system once per round
                for name, options in systems.items():
                    result = run_worker(args, *options)
                    outputs[name] = result["outputs"]
                    best_s[name] = min(best_s.get(name, float("inf")), result["seconds"])
            for name in systems:
                distinct = len({tuple(o) for o in outputs[name]})  # a stuck random model would agree trivially
                rows.append((arch, precision, name, best_s[name], generated / best_s[name],
                             best_s[name] / best_s["engine"], agreement(outputs[name], outputs["engine"]),
                             distinct))
    print(f"{'model':8} {'prec':5} {'system':16} {'seconds':>9} {'tok/s':>9} {'engine x':>9}  {'same as engine':14}"
          " distinct outputs")
    for arch, precision, name, seconds, rate, ratio, same, distinct in rows:
        print(f"{arch:8} {precision:5} {name:16} {seconds:9.2f} {rate:9.1f} {ratio:9.2f}  {same:14} {distinct}")
    print("\nengine x = the system's time over the engine's (targets: >= 1.3 against CTranslate2 at the same "
          "precision, >= 3 against HF)")


if __name__ == "__main__":
    main()
