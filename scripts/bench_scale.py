"""Scaling of a batch job on Ray: the same job in one process, on 1 worker and on 2 workers (1 thread each).

Checks that every run gives the same outputs, then prints the scaling efficiency, the overhead Ray adds
to a job (cluster start; actor start and model load compared with loading in-process) and a projection,
on paper, for 8 machines x 8 workers from the measured per-worker throughput and overhead.

    python scripts/bench_scale.py                                  # BART generate, 256 prompts
    python scripts/bench_scale.py --workload whisper --num-inputs 32   # tiny.en, the bundled clips
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

CLIPS = ["fox.wav", "coffee.wav", "weather.wav", "stella.wav", "thanks_fast.wav", "learning.wav"]


def make_inputs(args, tmp: Path) -> tuple[str | None, list[str] | Path]:
    """(model, inputs): a random-init BART and a prompt file, or tiny.en (None) and audio files."""
    if args.workload == "whisper":
        import shutil

        paths = []
        for i in range(args.num_inputs):  # copies, so that every input has its own name and output files
            src = ROOT / "prompts" / "audio" / CLIPS[i % len(CLIPS)]
            paths.append(str(shutil.copy(src, tmp / f"{i:04d}-{src.name}")))
        return None, paths
    from helpers import corpus, make_bart

    model = make_bart(tmp / "bart", args.bart_size)
    rng = random.Random(0)
    texts = corpus(4 * args.num_inputs, seed=1)
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(" ".join(rng.sample(texts, rng.randint(1, 4)))) + "\n"
                               for _ in range(args.num_inputs)))
    return str(model), prompts


def in_process(args, model, inputs) -> tuple[float, float, list]:
    """(load seconds, run seconds, outputs) with one engine on one thread in this process."""
    import torch

    from encdec_engine import LLM, SamplingParams
    from encdec_engine.inputs.prompt_files import load_prompt_file
    from encdec_engine.checkpoints.ct2.importer import default_model_path

    torch.set_num_threads(1)
    start = time.perf_counter()
    llm = LLM(model=model or str(default_model_path()), **ENGINE)
    loaded = time.perf_counter()
    if args.workload == "whisper":
        outs = [t.text for t in llm.transcribe(inputs, max_in_flight=args.batch_size)]
    else:
        # The workers' batches (consecutive inputs), one engine call each as a worker makes them: a random
        # model's near-ties can resolve differently in another batch, which the check must not mistake.
        prompts = [p for p, _ in load_prompt_file(inputs)]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        outs = [list(o.outputs[0].token_ids) for i in range(0, len(prompts), args.batch_size)
                for o in llm.generate(prompts[i:i + args.batch_size], params, use_tqdm=False)]
    return loaded - start, time.perf_counter() - loaded, outs


def on_ray(args, model, inputs, workers: int) -> tuple[float, list, float]:
    """(wall seconds, outputs in input order, audio seconds) of the job on `workers` workers."""
    from encdec_engine import distributed

    start = time.perf_counter()
    common = dict(num_workers=workers, threads_per_worker=1, batch_size=args.batch_size, engine=ENGINE,
                  progress=False)
    if args.workload == "whisper":
        rows = distributed.transcribe(inputs, **common)
        return time.perf_counter() - start, [r["text"] for r in rows], sum(r["duration"] for r in rows)
    rows = distributed.generate(inputs, model, max_tokens=args.max_tokens, temperature=0.0, **common)
    return time.perf_counter() - start, [r["token_ids"] for r in rows], 0.0


ENGINE = {"kv_cache_space_gb": 0.5}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=["bart", "whisper"], default="bart")
    p.add_argument("--num-inputs", type=int, default=256,
                   help="enough that running outweighs the fixed overhead (about 15 s per job here)")
    p.add_argument("--batch-size", type=int, default=8, help="inputs per worker batch")
    p.add_argument("--max-tokens", type=int, default=64, help="bart: tokens per prompt")
    p.add_argument("--bart-size", default="small", help="an entry of models/configs/bart.json")
    args = p.parse_args()

    import ray

    with tempfile.TemporaryDirectory() as tmp:
        model, inputs = make_inputs(args, Path(tmp))
        load_s, run_s, reference = in_process(args, model, inputs)
        start = time.perf_counter()
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=256 << 20, logging_level="WARNING")
        cluster_s = time.perf_counter() - start
        try:
            one_s, one_out, audio_s = on_ray(args, model, inputs, 1)
            two_s, two_out, _ = on_ray(args, model, inputs, 2)
        finally:
            ray.shutdown()
    for name, outs in (("1 worker", one_out), ("2 workers", two_out)):
        same = sum(a == b for a, b in zip(outs, reference))
        print(f"{name}: {same}/{len(reference)} outputs equal to the in-process run")
        if same != len(reference):
            raise SystemExit(f"{name} gave other outputs than the in-process run")
    report(args, load_s, run_s, cluster_s, one_s, two_s, audio_s)


def report(args, load_s: float, run_s: float, cluster_s: float, one_s: float, two_s: float, audio_s: float) -> None:
    n = args.num_inputs
    # A job's fixed cost on Ray: what the 1-worker job takes beyond loading and running in-process
    # (actor start, Dataset planning, rows through the object store) plus the model load itself.
    ray_overhead_s = one_s - run_s
    per_worker_rate = n / run_s  # inputs per second of one engine on one thread, once loaded
    efficiency = one_s / (2 * two_s)
    steady_efficiency = run_s / (2 * max(two_s - ray_overhead_s, 1e-9))
    unit = "clips" if args.workload == "whisper" else "prompts"
    print(f"\n{args.workload}: {n} {unit}, batch {args.batch_size}, 1 thread per engine")
    print(f"  in-process: load {load_s:.1f} s, run {run_s:.1f} s ({per_worker_rate:.2f} {unit}/s)")
    print(f"  Ray cluster start (ray.init, local): {cluster_s:.1f} s")
    print(f"  Ray 1 worker: {one_s:.1f} s wall; overhead over the in-process run {ray_overhead_s:.1f} s "
          f"(of which model load {load_s:.1f} s)")
    print(f"  Ray 2 workers: {two_s:.1f} s wall; speed-up {one_s / two_s:.2f}x, scaling efficiency {efficiency:.0%} "
          f"(without the fixed overhead {steady_efficiency:.0%})")
    if run_s < ray_overhead_s:
        print("  (the run is shorter than the fixed overhead: the figures without it are noise; use more inputs)")
    if audio_s:
        print(f"  audio: {audio_s:.0f} s; 2 workers: {audio_s / two_s:.1f} audio s per s")
    workers = 64
    for total in (10_000, 1_000_000):
        projected = ray_overhead_s + total / (workers * per_worker_rate * min(steady_efficiency, 1.0))
        print(f"  projection, 8 machines x 8 workers (1 thread each), {total:,} {unit}: {projected / 60:.1f} min "
              f"(the measured overhead once, then {workers} x the per-worker rate x the 2-worker efficiency; "
              "assumes inputs on shared storage and a network that keeps up)")


if __name__ == "__main__":
    main()
