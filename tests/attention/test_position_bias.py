"""The additive per-head position bias (T5's buckets, ALiBi's slopes) through the torch backend, against
naive attention with the bias written out per (query, key) pair; T5's table against HF's compute_bias."""

import numpy as np
import pytest
import torch
from helpers import make_view

from encdec_engine.attention.backends.base import store_kv
from encdec_engine.attention.backends.torch_sdpa import TorchSDPABackend
from encdec_engine.attention.metadata import AttentionMetadata
from encdec_engine.attention.position_bias import (alibi_bias, alibi_slopes, t5_bucket_index, t5_position_bias)
from encdec_engine.quantization.kv_int8 import dequantize_kv, quantize_kv, row_width
from encdec_engine.worker.input_prep import pad_rows

H, D, BS = 4, 8, 4


def t5_bias(num_heads=H, bidirectional=True, num_buckets=8, max_distance=12, seed=0):
    torch.manual_seed(seed)
    index, low = t5_bucket_index(bidirectional, num_buckets, max_distance)
    return t5_position_bias(torch.randn(num_buckets, num_heads), index, low)


BIASES = {"t5": t5_bias, "alibi": lambda **_: alibi_bias(alibi_slopes(H), 64)}


def naive_biased(q, k, v, scale, bias_fn, causal):
    """One sequence: q [q, H, D] are its last q keys' queries; bias_fn(query_pos, key_pos) -> [H]."""
    q_len, k_len = q.shape[0], k.shape[0]
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = torch.einsum("thd,khd->htk", q.double(), k) * scale
    for j in range(q_len):
        pos = k_len - q_len + j
        for p in range(k_len):
            scores[:, j, p] += bias_fn(pos, p).double()
            if causal and p > pos:
                scores[:, j, p] = float("-inf")
    return torch.einsum("htk,khd->thd", scores.softmax(-1), v)


def explicit(bias):
    """The bias of (query position, key position) from its table, written out."""
    def fn(qpos, kpos):
        column = min(max(kpos - qpos - bias.min_relative, 0), bias.table.shape[1] - 1)
        return bias.table[:, column]
    return fn


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (8, 12), (6, 20), (16, 9)])
def test_t5_table_equals_hf_compute_bias(bidirectional, num_buckets, max_distance):
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention

    config = T5Config(d_model=16, d_kv=4, num_heads=3, relative_attention_num_buckets=num_buckets,
                      relative_attention_max_distance=max_distance, is_decoder=not bidirectional)
    attn = T5Attention(config, has_relative_attention_bias=True)
    torch.nn.init.normal_(attn.relative_attention_bias.weight)
    index, low = t5_bucket_index(bidirectional, num_buckets, max_distance)
    bias = t5_position_bias(attn.relative_attention_bias.weight.detach(), index, low)
    # queries at positions past .. past + q_len - 1 over keys 0 .. past + q_len - 1 (prefill and decode)
    for q_len, past in [(7, 0), (1, 299), (40, 360), (2 * max_distance + 9, 0), (1, 0)]:
        hf = attn.compute_bias(q_len, past + q_len, past_seen_tokens=past)[0].detach()
        assert torch.equal(bias.block(q_len, past + q_len), hf)


@pytest.mark.parametrize("kind", ["t5", "alibi"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("num_kv_heads", [H, 2])
def test_fresh_prefill_adds_the_bias_per_sequence(kind, causal, num_kv_heads):
    torch.manual_seed(1)
    lens = [3, 1, 5, 5, 2, 17, 5]  # two sequences of one shape share a mask
    bias = BIASES[kind](bidirectional=not causal)
    k_start = np.concatenate([[0], np.cumsum(lens)[:-1]]).tolist()
    view = make_view(lens, lens, causal, key_start_loc=k_start)
    total = sum(lens)
    q, k, v = torch.randn(total, H, D), torch.randn(total, num_kv_heads, D), torch.randn(total, num_kv_heads, D)
    backend = TorchSDPABackend(BS)
    backend.plan(AttentionMetadata(decoder=view, block_size=BS))
    out = backend.forward(q, k, v, None, view, D**-0.5, bias)
    for start, n in zip(k_start, lens):
        seq = slice(start, start + n)
        ref = naive_biased(q[seq], k[seq], v[seq], D**-0.5, explicit(bias), causal)
        torch.testing.assert_close(out[seq].double(), ref, rtol=1e-5, atol=1e-5)
    # Uniform segments take the reshaped batch path.
    view = make_view([4] * 3, [4] * 3, causal, key_start_loc=[0, 4, 8])
    out = TorchSDPABackend(BS).forward(q[:12], k[:12], v[:12], None, view, D**-0.5, bias)
    for s in (0, 4, 8):
        ref = naive_biased(q[s : s + 4], k[s : s + 4], v[s : s + 4], D**-0.5, explicit(bias), causal)
        torch.testing.assert_close(out[s : s + 4].double(), ref, rtol=1e-5, atol=1e-5)


def paged(k_lens, num_kv_heads, rng, dtype=torch.float32, contiguous=False):
    num_blocks = sum(-(-n // BS) for n in k_lens) + 3
    cache = torch.zeros(2, num_blocks + 1, BS, num_kv_heads, row_width(D, dtype), dtype=dtype)
    order = np.arange(1, num_blocks + 1)
    free = list(order[::-1] if contiguous else rng.permutation(order))
    tables, ks, vs = [], [], []
    for n in k_lens:
        table = [int(free.pop()) for _ in range(-(-n // BS))]
        k, v = torch.randn(n, num_kv_heads, D), torch.randn(n, num_kv_heads, D)
        pos = np.arange(n)
        store_kv(k, v, cache, torch.tensor(np.array(table)[pos // BS] * BS + pos % BS))
        if dtype == torch.int8:
            k, v = (dequantize_kv(quantize_kv(x), D) for x in (k, v))
        tables.append(table)
        ks.append(k)
        vs.append(v)
    return cache, torch.from_numpy(pad_rows(tables)), ks, vs


@pytest.mark.parametrize("kind", ["t5", "alibi"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("k_lens,contiguous", [([1, 9, 4, 17], False), ([130, 257, 3], True), ([140], True)])
def test_paged_decode_adds_the_bias_at_the_last_position(kind, cache_dtype, k_lens, contiguous):
    """Gathered (short contexts), read in place (long contiguous ones), float and int8 caches."""
    torch.manual_seed(2)
    bias = BIASES[kind](bidirectional=False)
    cache, tables, ks, vs = paged(k_lens, 2, np.random.default_rng(2), cache_dtype, contiguous)
    view = make_view([1] * len(k_lens), k_lens, True, block_tables=tables)
    backend = TorchSDPABackend(BS)
    backend.plan(AttentionMetadata(decoder=view, block_size=BS))
    q = torch.randn(len(k_lens), H, D)
    out = backend.forward(q, None, None, cache, view, D**-0.5, bias)
    for i, n in enumerate(k_lens):
        ref = naive_biased(q[i : i + 1], ks[i], vs[i], D**-0.5, explicit(bias), True)
        torch.testing.assert_close(out[i : i + 1].double(), ref, rtol=1e-5, atol=1e-5)


def test_prefill_over_a_cached_prefix_places_queries_after_it():
    torch.manual_seed(3)
    bias = t5_bias(bidirectional=False, seed=3)
    q_lens, k_lens = [2, 3, 1], [5, 3, 8]
    cache, tables, ks, vs = paged(k_lens, H, np.random.default_rng(3))
    view = make_view(q_lens, k_lens, True, block_tables=tables)
    backend = TorchSDPABackend(BS)
    backend.plan(AttentionMetadata(decoder=view, block_size=BS))
    q = torch.randn(sum(q_lens), H, D)
    out = backend.forward(q, None, None, cache, view, D**-0.5, bias)
    again = backend.forward(q, None, None, cache, view, D**-0.5, bias)  # the step's mask, kept for every layer
    assert torch.equal(out, again) and len(view.plan.bias_masks) == 1
    start = 0
    for i, (ql, kl) in enumerate(zip(q_lens, k_lens)):
        ref = naive_biased(q[start : start + ql], ks[i], vs[i], D**-0.5, explicit(bias), True)
        torch.testing.assert_close(out[start : start + ql].double(), ref, rtol=1e-5, atol=1e-5)
        start += ql


def test_alibi_slopes_are_the_papers():
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    # 12 heads: the 8 of 8 heads, then every other slope of 16 heads
    expected = [2.0 ** -(i + 1) for i in range(8)] + [2.0 ** -(0.5 * (2 * i + 1)) for i in range(4)]
    assert torch.allclose(alibi_slopes(12), torch.tensor(expected))
    bias = alibi_bias(alibi_slopes(4), 16)
    assert torch.allclose(bias.block(1, 5)[:, 0], alibi_slopes(4)[:, None] * torch.arange(-4.0, 1.0)[None, :])
