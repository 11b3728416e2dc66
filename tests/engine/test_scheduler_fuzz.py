"""Differential fuzzing of scheduling and KV accounting: tight pools must give a roomy pool's outputs.

Random workloads (mixed lengths, greedy, seeded n > 1 and best_of, shared encoder inputs and
decoder prefixes, requests arriving mid-run) run on a roomy engine and on tight ones that
preempt (recompute or swap) and share cached blocks. Every request gets the same tokens,
except one that outgrows the tight pool or prefill budget: it ends early as "length" with a
prefix of its roomy output. Leaks are checked after every test (conftest).
"""

import os
import random

import pytest

from encdec_engine import SamplingParams

TIGHT = [dict(num_kv_blocks=24, block_size=4), dict(num_kv_blocks=32, block_size=4, swap_space_gb=0.001),
         dict(num_kv_blocks=20, block_size=8, enable_prefix_caching=False),
         dict(num_kv_blocks=40, block_size=4, max_num_seqs=6, max_num_batched_tokens=96, swap_space_gb=0.001),
         # Mixed steps, prompts (and recomputed requests) prefilled a chunk per step
         dict(num_kv_blocks=28, block_size=4, enable_chunked_prefill=True, max_num_batched_tokens=24,
              swap_space_gb=0.001),
         dict(num_kv_blocks=24, block_size=4, enable_chunked_prefill=True, max_num_batched_tokens=64)]


def workload(rng: random.Random) -> list[tuple[int, dict, SamplingParams]]:
    """(arrival step, prompt, params) for 4-7 requests; some share an encoder input or a decoder prefix."""
    encoders = [[0] + [rng.randrange(5, 590) for _ in range(rng.randint(2, 14))] + [2] for _ in range(3)]
    requests = []
    for _ in range(rng.randint(4, 7)):
        decoder = [2, 0] + [rng.randrange(5, 590) for _ in range(rng.choice([0, 0, 3, 9]))]
        prompt = {"encoder_prompt": {"prompt_token_ids": rng.choice(encoders)},
                  "decoder_prompt": {"prompt_token_ids": decoder}}
        kind = rng.choice(["greedy", "sample", "best_of"])
        common = dict(max_tokens=rng.randint(4, 24), ignore_eos=rng.random() < 0.5, seed=rng.randrange(1000))
        if kind == "greedy":
            params = SamplingParams(temperature=0.0, **common)
        elif kind == "sample":
            params = SamplingParams(n=rng.randint(1, 3), temperature=1.0, **common)
        else:
            params = SamplingParams(n=1, best_of=rng.randint(2, 3), temperature=1.0, **common)
        requests.append((rng.choice([0, 0, 2, 5]), prompt, params))
    return requests


def run(engine, requests) -> dict[str, list[tuple[list[int], str]]]:
    pending = sorted(((at, i) for i, (at, _, _) in enumerate(requests)), reverse=True)
    finished, step = {}, 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[-1][0] <= step:
            _, i = pending.pop()
            engine.add_request(f"r{i}", requests[i][1], requests[i][2])
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = [(c.token_ids, c.finish_reason) for c in out.outputs]
        step += 1
    return finished


# ENCDEC_FUZZ_SEEDS=2000 for a longer run than CI's 40 workloads.
@pytest.mark.parametrize("seed", range(int(os.environ.get("ENCDEC_FUZZ_SEEDS", "40"))))
def test_tight_pools_give_the_roomy_outputs(seed, bart_path, make_llm):
    rng = random.Random(seed)
    requests = workload(rng)
    roomy = run(make_llm(bart_path, num_kv_blocks=600).engine, requests)
    for config in rng.sample(TIGHT, 2):
        tight_engine = make_llm(bart_path, **config).engine
        tight = run(tight_engine, requests)
        for rid, outputs in roomy.items():
            if tight[rid] == outputs:
                continue
            params = requests[int(rid[1:])][2]
            # Only an early end (a request that outgrows the pool) is allowed: a prefix of the roomy output,
            # or, where best-of chooses among candidates, any candidate cut short (the choice depends on the cut).
            for (got, reason), (want, _) in zip(tight[rid], outputs):
                assert reason == "length" and len(got) < len(want), (rid, config)
                assert params.best_of > params.n or got == want[: len(got)], (rid, config)
