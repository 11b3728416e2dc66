"""The engine's features on the text family: prefix caching (T5's position bias over a cached decoder prefix),
preemption by swapping and recomputing, n > 1 and seeded sampling, int8 weights and the int8 KV cache
(T5's d_kv of 16 and 20: partial scale groups), each against the engine without the feature."""

import pytest
import torch
from helpers import assert_preemption_keeps_outputs, mixed_prompts, tokens
from torch import nn

from encdec_engine import SamplingParams
from encdec_engine.quantization.int8_weights import Int8Linear

ENCODER = {"prompt_token_ids": list(range(20, 80)) + [1]}


def generate(llm, prompts, params):
    return tokens(llm.generate(prompts, params, use_tqdm=False))


def test_t5_prefix_caching_reuses_encoder_and_decoder_prefix(text_model, make_llm):
    path = text_model("t5")
    on = make_llm(path, num_kv_blocks=500, block_size=4)
    off = make_llm(path, num_kv_blocks=500, block_size=4, enable_prefix_caching=False)
    prefix = [0] + list(range(30, 44))  # three full blocks and a partial one, read back with their positions
    prompts = [{"encoder_prompt": ENCODER, "decoder_prompt": {"prompt_token_ids": prefix + [60 + i]}}
               for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=10)
    generate(on, prompts[:1], params)
    runs, hits = on.engine.stats["encoder_runs"], on.engine.block_manager.cache_stats["self_block_hits"]
    assert generate(on, prompts, params) == generate(off, prompts, params)
    assert on.engine.stats["encoder_runs"] == runs  # the encoder output was cached
    assert on.engine.block_manager.cache_stats["self_block_hits"] - hits >= 6 * 3
    mixed = mixed_prompts(on.get_tokenizer(), n=8, seed=51)
    mixed = mixed + mixed[:4]
    assert generate(on, mixed, params) == generate(off, mixed, params)


@pytest.mark.parametrize("arch", ["t5", "m2m100"])
def test_preemption_keeps_outputs(arch, text_model, make_llm):
    path = text_model(arch)
    prompts = mixed_prompts(make_llm(path, num_kv_blocks=400).get_tokenizer(), n=10, seed=52)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, truncate_prompt_tokens=120)
    assert_preemption_keeps_outputs(make_llm, path, prompts, params, num_kv_blocks=40, block_size=4,
                                    swap_space_gb=0.001 if arch == "t5" else 0.0)


def test_n_samples_are_seeded_and_batch_invariant(text_model, make_llm):
    llm = make_llm(text_model("marian"), num_kv_blocks=400)
    prompts = mixed_prompts(llm.get_tokenizer(), n=5, seed=53)
    params = SamplingParams(temperature=1.0, n=3, best_of=4, seed=11, max_tokens=10)
    first = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
    again = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts[::-1], params, use_tqdm=False)][::-1]
    assert first == again and all(len(o) == 3 for o in first)
    assert any(len({tuple(c) for c in o}) > 1 for o in first)  # samples differ


@pytest.mark.parametrize("arch,name", [("t5", "small"), ("mbart", "small"),
                                       pytest.param("t5", "gated_untied", marks=pytest.mark.slow),
                                       pytest.param("marian", "small", marks=pytest.mark.slow)])
def test_int8_weights_quantize_every_linear_and_agree(arch, name, text_model, make_llm):
    """Every linear (the untied head and T5's fused gated FFN included) runs int8. The random models' wide
    weights amplify rounding layer after layer (random BART's first tokens agree with fp32 on 3 of these
    10 prompts), so the bound is loose: int8's first token among fp32's five most likely on at least 4 of
    10 prompts (measured: T5 8, mBART 5, BART 7)."""
    path = text_model(arch, name)
    fp32, int8 = make_llm(path, num_kv_blocks=300), make_llm(path, num_kv_blocks=300, quantization="int8")
    model = int8.engine.model
    assert not [n for n, m in model.named_modules() if type(m) is nn.Linear]
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) > 0
    prompts = mixed_prompts(fp32.get_tokenizer(), n=10, seed=54)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, truncate_prompt_tokens=120)
    assert all(len(g) == 6 for g in generate(int8, prompts, params))
    first = SamplingParams(temperature=0, max_tokens=1, logprobs=5, truncate_prompt_tokens=120)
    ref, got = (llm.generate(prompts, first, use_tqdm=False) for llm in (fp32, int8))
    assert sum(g.outputs[0].token_ids[0] in r.outputs[0].logprobs[0] for g, r in zip(got, ref)) >= 4


@pytest.mark.parametrize("arch,name", [("t5", "small"), ("m2m100", "small"),
                                       pytest.param("t5", "gated_untied", marks=pytest.mark.slow)])
def test_int8_kv_cache_agrees_with_fp32_cache(arch, name, text_model, make_llm):
    path = text_model(arch, name)
    fp32 = make_llm(path, num_kv_blocks=400, block_size=4)
    int8 = make_llm(path, num_kv_blocks=400, block_size=4, kv_cache_dtype="int8")
    assert int8.engine.cache_engine.kv_caches[0].dtype == torch.int8
    prompts = mixed_prompts(fp32.get_tokenizer(), n=10, seed=55)
    params = SamplingParams(temperature=0, max_tokens=12, truncate_prompt_tokens=120)
    ref, got = generate(fp32, prompts, params), generate(int8, prompts, params)
    assert sum(a[:3] == b[:3] for a, b in zip(got, ref)) >= 7
    # Cached prefixes and encoder outputs hold their scales: repeats give the first run's tokens.
    assert generate(int8, prompts[:4], params) == got[:4]


def test_t5_long_decoder_prompts_prefilled_in_chunks(text_model, make_llm):
    """Each chunk reads the position bias against the keys of the chunks before it (as a cached prefix)."""
    path = text_model("t5")
    # The 61-token encoder input runs whole in one step (with the decoder's first chunk); the decoder
    # prompts of 150 and 220 tokens take several steps each.
    chunked = make_llm(path, num_kv_blocks=500, block_size=4, enable_chunked_prefill=True, max_num_batched_tokens=80)
    whole = make_llm(path, num_kv_blocks=500, block_size=4)
    prompts = [{"encoder_prompt": ENCODER, "decoder_prompt": {"prompt_token_ids": [0] + list(range(30, 30 + n))}}
               for n in (150, 3, 220, 90)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    steps = chunked.engine.stats["prefill_steps"]
    assert generate(chunked, prompts, params) == generate(whole, prompts, params)
    assert chunked.engine.stats["prefill_steps"] - steps >= (150 + 3 + 220 + 90) // 80  # really chunked
