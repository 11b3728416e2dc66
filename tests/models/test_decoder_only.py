"""Decoder-only models (GPT-2, Llama) as the degenerate case: same scheduler, block manager and
runner, no encoder step, no cross table. Greedy parity with HF `generate` on random-init checkpoints."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from helpers import (assert_preemption_keeps_outputs, causal_prompts, hf_causal_greedy, make_bart_tokenizer,
                     make_causal_lm, model_entry)
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from encdec_engine import SamplingParams

# Shapes vary so nothing is special-cased (models/configs/gpt2.json, llama.json): odd head counts, untied
# heads, layer-scaled attention, GQA (4 heads on 2 KV heads) and MQA (3 on 1) with head_dim != hidden /
# heads, biases, RoPE bases; some untied output heads boost EOS so that some requests stop on it.
CONFIGS: dict[str, tuple[str, str]] = {
    "gpt2": ("gpt2", "tiny"),
    "gpt2_odd": ("gpt2", "odd"),
    "llama_gqa": ("llama", "gqa"),
    "llama_mqa": ("llama", "mqa"),
}
_HF_CLASSES = {"gpt2": GPT2LMHeadModel, "llama": LlamaForCausalLM}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("decoder_only")
    tok = make_bart_tokenizer(root / "tokenizer")
    return {name: make_causal_lm(root / name, tok, arch, entry) for name, (arch, entry) in CONFIGS.items()}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_mixed_batch_matches_hf(config, paths, make_llm):
    llm = make_llm(paths[config], num_kv_blocks=400)
    prompts = causal_prompts(len(llm.get_tokenizer()), n=12, seed=list(CONFIGS).index(config))
    max_tokens = [2 + (7 * i) % 19 for i in range(len(prompts))]
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens], use_tqdm=False)
    lens = [len(o.prompt_token_ids) for o in outs]
    assert min(lens) <= 2 and max(lens) >= 60  # really mixed
    assert all(o.encoder_prompt_token_ids is None for o in outs)

    model = _HF_CLASSES[CONFIGS[config][0]].from_pretrained(paths[config]).eval()
    ref = [hf_causal_greedy(model, o.prompt_token_ids, m) for o, m in zip(outs, max_tokens)]
    mismatches = [i for i, (o, r) in enumerate(zip(outs, ref)) if o.outputs[0].token_ids != r]
    assert not mismatches, f"{len(mismatches)}/{len(outs)} differ from HF: {mismatches}"
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > len(outs) // 2  # not one repeated token
    if "eos_boost" in model_entry(*CONFIGS[config]):
        assert any(o.outputs[0].finish_reason == "stop" for o in outs)  # EOS ends some requests early


def test_explicit_encoder_decoder_prompt_is_rejected(paths, make_llm):
    llm = make_llm(paths["gpt2"], num_kv_blocks=400)
    with pytest.raises(ValueError, match="decoder-only"):
        llm.generate(["fine", {"encoder_prompt": "The rain", "decoder_prompt": "in spain"}], use_tqdm=False)
    # The engine is still usable afterwards (and the leak check sees nothing queued).
    assert len(llm.generate("The rain", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)) == 1


def test_prompt_over_the_prefill_budget_is_refused_when_added(paths, make_llm):
    llm = make_llm(paths["gpt2"], num_kv_blocks=400, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="100 prefill positions in one step, more than max_num_batched_tokens=64"):
        llm.generate({"prompt_token_ids": [5] * 100}, SamplingParams(max_tokens=2), use_tqdm=False)


def test_same_outputs_under_memory_pressure(paths, make_llm):
    path = paths["llama_gqa"]
    rng = random.Random(7)
    # Up to 40 + 24 tokens = 16 blocks each: every request fits the pool alone, not all at once.
    prompts = [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(n)]} for n in (1, 3, 8, 17, 30, 40, 5, 12, 25, 2)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    assert_preemption_keeps_outputs(make_llm, path, prompts, params, num_kv_blocks=24, block_size=4)


def test_seeded_sampling_with_n_samples(paths, make_llm):
    llm = make_llm(paths["gpt2_odd"], num_kv_blocks=400)
    prompt = {"prompt_token_ids": [5, 17, 300, 42, 9]}

    def sample(seed: int) -> list[tuple[int, ...]]:
        params = SamplingParams(n=3, temperature=1.0, top_k=50, seed=seed, max_tokens=8, ignore_eos=True)
        out = llm.generate([prompt, "another request in the batch"], params, use_tqdm=False)[0]
        assert len(out.outputs) == 3 and all(len(c.token_ids) == 8 for c in out.outputs)
        return [tuple(c.token_ids) for c in out.outputs]

    first = sample(1234)
    assert sample(1234) == first  # reproducible run to run
    assert len(set(first)) > 1  # the n samples differ
    assert sample(99) != first


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "linear", "factor": 4.0},
                                          {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_rotary_tables_are_bitwise_hf(rope_scaling):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from encdec_engine.layers.rotary import apply_rotary
    from encdec_engine.models.llama import make_rotary

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=5000.0, max_position_embeddings=512,
                         rope_scaling=rope_scaling)
    positions = torch.tensor([0, 1, 2, 7, 63, 64, 65, 300, 511])
    cos_hf, sin_hf = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions[None])
    cos, sin = make_rotary(config, 16)(positions, torch.float32)
    assert torch.equal(cos[:, 0], cos_hf[0]) and torch.equal(sin[:, 0], sin_hf[0])
    x = torch.randn(len(positions), 4, 16)
    ref, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos_hf, sin_hf)
    assert torch.equal(apply_rotary(x, cos, sin), ref[0].transpose(0, 1))


def test_gelu_new_is_bitwise_hf():
    from transformers.activations import NewGELUActivation

    from encdec_engine.layers.activation import gelu_new

    x = torch.randn(100_000) * 4
    assert torch.equal(gelu_new(x), NewGELUActivation()(x))


def test_unsupported_options_fail_at_load():
    from encdec_engine.attention.backends.torch_sdpa import TorchSDPABackend
    from encdec_engine.models.gpt2 import GPT2LMHeadModel as OurGPT2
    from encdec_engine.models.llama import LlamaForCausalLM as OurLlama

    backend = TorchSDPABackend(16)
    with pytest.raises(ValueError, match="reorder_and_upcast_attn"):
        OurGPT2(GPT2Config(n_embd=32, n_head=2, n_layer=1, reorder_and_upcast_attn=True), backend)
    with pytest.raises(ValueError, match="rope type 'dynamic'"):
        OurLlama(LlamaConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1,
                             rope_scaling={"rope_type": "dynamic", "factor": 2.0}), backend)


@pytest.mark.parametrize("config", ["gpt2_odd", "llama_gqa"])
def test_loading_is_strict(config, paths):
    from encdec_engine.attention.backends.torch_sdpa import TorchSDPABackend
    from encdec_engine.models.registry import resolve_model_class
    from encdec_engine.checkpoints.weights import iter_checkpoint

    model_cls = _HF_CLASSES[CONFIGS[config][0]]
    hf_config = model_cls.config_class.from_pretrained(paths[config])
    ours = resolve_model_class(hf_config)
    weights = dict(iter_checkpoint(paths[config]))
    dropped = next(n for n in weights if "k_proj" in n or "c_attn" in n)
    with pytest.raises(ValueError, match="missing weights"):
        ours(hf_config, TorchSDPABackend(16)).load_weights((n, t) for n, t in weights.items() if n != dropped)
    with pytest.raises(ValueError, match="unexpected weights"):
        ours(hf_config, TorchSDPABackend(16)).load_weights([*weights.items(), ("extra.weight", torch.zeros(2))])


@pytest.mark.parametrize("name", ["gpt2_odd", "llama_gqa"])
def test_shared_prompt_prefixes_are_cached(paths, make_llm, name):
    on = make_llm(paths[name], num_kv_blocks=200, block_size=4)
    off = make_llm(paths[name], num_kv_blocks=200, block_size=4, enable_prefix_caching=False)
    prefix = list(range(20, 57))
    prompts = [{"prompt_token_ids": prefix + [60 + i, 70 + i]} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=8)
    hits = on.engine.block_manager.cache_stats["self_block_hits"]
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in on.generate(prompts, params, use_tqdm=False)] == \
            [o.outputs[0].token_ids for o in off.generate(prompts, params, use_tqdm=False)]
    assert on.engine.block_manager.cache_stats["self_block_hits"] - hits >= 9 * 6  # 9 shared full blocks
