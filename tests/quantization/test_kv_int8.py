"""The int8 KV cache (kv_cache_dtype="int8"): the row layout, the torch backend's reads against
attention over the dequantized values, and whole engines against the fp32 cache."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import make_view, mixed_prompts
from helpers import naive_attention as naive

from encdec_engine import SamplingParams
from encdec_engine.attention.backends.base import store_kv
from encdec_engine.attention.backends.torch_sdpa import TorchSDPABackend, GatherPlan, SlicePlan
from encdec_engine.attention.backends.xformers_masks import prefill_attn_bias
from encdec_engine.quantization.kv_int8 import (KV_QUANT_GROUP, as_stored, dequantize_kv, quantize_kv, row_width,
                                              tokens_ratio)
from encdec_engine.attention.metadata import AttentionMetadata
from encdec_engine.checkpoints.ct2.importer import default_model_path
from encdec_engine.models.interface import KVCacheSpec
from encdec_engine.worker.cache_engine import bytes_per_block
from encdec_engine.worker.input_prep import pad_rows
from encdec_engine.worker.kv_sizing import KVPoolReport

AUDIO = Path(__file__).resolve().parents[2] / "prompts" / "audio"
SHORT_CLIPS = sorted(n for n in json.loads((AUDIO / "transcripts.json").read_text()) if not n.startswith("long"))
EXACT = dict(timestamps=False, temperatures=(0.0,))


@pytest.mark.parametrize("head_dim", [8, 12, 40, 64, 100])
def test_rows_round_each_group_to_half_its_step(head_dim):
    torch.manual_seed(0)
    x = torch.randn(5, 3, head_dim) * torch.logspace(-3, 2, 5)[:, None, None]
    x[0, 1] = 0  # an all-zero head: its scales are 1 and its values 0
    rows = quantize_kv(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, 3, row_width(head_dim, torch.int8))
    back = dequantize_kv(rows, head_dim)
    groups = torch.nn.functional.pad(x, (0, -head_dim % KV_QUANT_GROUP)).unflatten(-1, (-1, KV_QUANT_GROUP))
    step = (groups.abs().amax(-1) / 127).repeat_interleave(KV_QUANT_GROUP, -1)[..., :head_dim]
    assert ((back - x).abs() <= step / 2 * (1 + 1e-6)).all()
    assert torch.equal(back[0, 1], torch.zeros(head_dim))
    assert torch.equal(quantize_kv(back), rows)  # stored values are a fixed point: re-storing changes nothing


def test_row_width_and_how_many_more_tokens_fit():
    assert row_width(64, torch.int8) == 64 + 4 and row_width(64, torch.float32) == 64  # one scale per row
    assert row_width(12, torch.int8) == 12 + 4 and row_width(30, torch.int8) == 32 + 4  # values padded to 4 bytes
    assert row_width(128, torch.int8) == 128 + 2 * 4  # two groups
    assert tokens_ratio(64, torch.int8) == pytest.approx(256 / 68)  # tiny.en: 3.76x
    assert tokens_ratio(128, torch.int8) == pytest.approx(512 / 136)
    spec = KVCacheSpec(num_layers=4, num_kv_heads=6, head_dim=64)
    assert bytes_per_block(spec, 16, torch.int8) == 2 * 4 * 16 * 6 * 68
    report = KVPoolReport(spec=spec, block_size=16, dtype=torch.int8, num_blocks=100).describe()
    assert "int8 with a float32 scale per 64 dims: 3.76x the tokens of float32" in report


def int8_paged(k_lens, num_kv_heads, head_dim, block_size, contiguous, seed):
    """Contexts stored in an int8 cache (contiguous or shuffled blocks); returns the cache, the tables
    and each context's K/V as the cache holds them (dequantized)."""
    rng = np.random.default_rng(seed)
    num_blocks = sum(-(-n // block_size) for n in k_lens) + 2
    order = list(range(1, num_blocks + 1)) if contiguous else list(rng.permutation(np.arange(1, num_blocks + 1)))
    cache = torch.zeros(2, num_blocks + 1, block_size, num_kv_heads, row_width(head_dim, torch.int8),
                        dtype=torch.int8)
    tables, ks, vs = [], [], []
    for n in k_lens:
        table = [int(order.pop(0)) for _ in range(-(-n // block_size))]
        k, v = torch.randn(n, num_kv_heads, head_dim) * 2, torch.randn(n, num_kv_heads, head_dim)
        pos = np.arange(n)
        store_kv(k, v, cache, torch.tensor(np.array(table)[pos // block_size] * block_size + pos % block_size))
        tables.append(table)
        ks.append(dequantize_kv(quantize_kv(k), head_dim))
        vs.append(dequantize_kv(quantize_kv(v), head_dim))
    return cache, torch.from_numpy(pad_rows(tables)), ks, vs


@pytest.mark.parametrize("head_dim", [40, 100])  # one scale per row (folded into the scores), two groups
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k_lens,contiguous,plan", [([1, 9, 17, 4], False, GatherPlan),
                                                     ([130, 300, 129], True, SlicePlan)])
def test_torch_decode_over_int8_cache_equals_attention_over_dequantized_values(k_lens, contiguous, plan,
                                                                                 query_dtype, head_dim):
    num_heads, num_kv_heads, block_size = 4, 2, 4
    torch.manual_seed(1)
    cache, tables, ks, vs = int8_paged(k_lens, num_kv_heads, head_dim, block_size, contiguous, seed=1)
    view = make_view([1] * len(k_lens), k_lens, False, block_tables=tables)
    backend = TorchSDPABackend(block_size)
    backend.plan(AttentionMetadata(decoder=view, block_size=block_size))
    assert isinstance(view.plan, plan)
    q = torch.randn(len(k_lens), num_heads, head_dim).to(query_dtype)
    out = backend.forward(q, None, None, cache, view, head_dim**-0.5)
    assert out.dtype == query_dtype
    ref = torch.cat([naive(q[i : i + 1], ks[i], vs[i], head_dim**-0.5) for i in range(len(k_lens))])
    tol = 1e-5 if query_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_torch_prefill_over_an_int8_prefix_is_bottom_right_causal():
    head_dim, block_size = 16, 4
    q_lens, k_lens = [2, 3, 1], [5, 3, 8]
    torch.manual_seed(2)
    cache, tables, ks, vs = int8_paged(k_lens, 4, head_dim, block_size, contiguous=False, seed=2)
    view = make_view(q_lens, k_lens, True, block_tables=tables)
    q = torch.randn(sum(q_lens), 4, head_dim)
    out = TorchSDPABackend(block_size).forward(q, None, None, cache, view, head_dim**-0.5)
    mask = prefill_attn_bias(view).materialize((sum(q_lens), sum(k_lens)))
    ref = naive(q, torch.cat(ks), torch.cat(vs), head_dim**-0.5, mask)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


# -- engines: int8 cache against the fp32 cache ------------------------------------------
def tokens(llm, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_whisper_int8_cache_agrees_with_fp32_cache(make_llm):
    """Stated bound: at least 6 of the 7 clips token for token (measured: 7/7); word timestamps
    (read back from the int8 cross cache) within 60 ms of the fp32 cache's."""
    fp32 = make_llm(default_model_path())
    int8 = make_llm(default_model_path(), kv_cache_dtype="int8")
    assert int8.engine.cache_engine.kv_caches[0].dtype == torch.int8
    files = [AUDIO / n for n in SHORT_CLIPS]
    ref = [r.segments[0].tokens for r in fp32.transcribe(files, **EXACT)]
    got = [r.segments[0].tokens for r in int8.transcribe(files, **EXACT)]
    assert sum(a == b for a, b in zip(got, ref)) >= 6
    words = [r.segments[0].words for r in (m.transcribe([AUDIO / "coffee.wav"], word_timestamps=True)[0]
                                           for m in (fp32, int8))]
    assert [w.word for w in words[0]] == [w.word for w in words[1]]
    assert max(abs(a.start - b.start) + abs(a.end - b.end) for a, b in zip(*words)) <= 0.06


def test_bart_int8_cache_agrees_with_fp32_cache(bart_path, make_llm):
    """Stated bound on random-init BART (wide init: tiny logit gaps, so any rounding can flip a token;
    greedy, 14 mixed prompts, 16 tokens): at least 6 outputs equal, and at least 11 equal in their
    first 3 tokens (measured on three prompt seeds: 7-8 equal, 12-14 over the first 3 tokens)."""
    fp32 = make_llm(bart_path, num_kv_blocks=400)
    int8 = make_llm(bart_path, num_kv_blocks=400, kv_cache_dtype="int8")
    prompts = mixed_prompts(fp32.get_tokenizer(), n=14, seed=3)
    params = SamplingParams(temperature=0, max_tokens=16)
    ref, got = tokens(fp32, prompts, params), tokens(int8, prompts, params)
    assert sum(a == b for a, b in zip(got, ref)) >= 6
    assert sum(a[:3] == b[:3] for a, b in zip(got, ref)) >= 11


def test_prefix_caching_and_swapping_carry_the_scales(bart_path, make_llm):
    """Cached cross blocks, copied forks and swapped-out blocks hold their scales: same tokens as a
    roomy int8 pool with caching off."""
    on = make_llm(bart_path, num_kv_blocks=500, block_size=4, kv_cache_dtype="int8")
    off = make_llm(bart_path, num_kv_blocks=500, block_size=4, kv_cache_dtype="int8", enable_prefix_caching=False)
    prompts = mixed_prompts(on.get_tokenizer(), n=8, seed=5)
    prompts = prompts + prompts[:4]
    params = SamplingParams(temperature=0, max_tokens=12)
    hits = on.engine.block_manager.cache_stats["cross_hits"]
    assert tokens(on, prompts, params) == tokens(off, prompts, params)
    assert on.engine.block_manager.cache_stats["cross_hits"] > hits
    beams = SamplingParams(num_beams=3, n=2, max_tokens=8)  # forks: copy-on-write of partial blocks
    assert [[c.token_ids for c in o.outputs] for o in on.generate(prompts[:4], beams, use_tqdm=False)] == \
        [[c.token_ids for c in o.outputs] for o in off.generate(prompts[:4], beams, use_tqdm=False)]
    prompts = mixed_prompts(on.get_tokenizer(), n=10, seed=6)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    squeezed = make_llm(bart_path, num_kv_blocks=24, block_size=4, swap_space_gb=0.01, kv_cache_dtype="int8",
                        reserve_decode_growth=False)
    before = squeezed.engine.scheduler.num_preemptions
    assert tokens(squeezed, prompts, params) == tokens(off, prompts, params)
    assert squeezed.engine.scheduler.num_preemptions > before, "the small pool should force preemption"


def test_fresh_values_are_attended_as_the_pool_keeps_them():
    """A bf16 pool keeps fp32 values rounded (compute type int8_bfloat16): the step that writes them attends the
    rounded ones too, as later steps read them. A pool as wide as the values gives them back as they are."""
    x = torch.randn(5, 2, 64)
    rounded = as_stored(x, torch.bfloat16)
    assert torch.equal(rounded, x.bfloat16().float()) and rounded.dtype == x.dtype
    assert as_stored(x, torch.float32) is x
    assert as_stored(x.bfloat16(), torch.bfloat16).dtype == torch.bfloat16
    assert torch.equal(as_stored(x, torch.int8), dequantize_kv(quantize_kv(x), 64))
