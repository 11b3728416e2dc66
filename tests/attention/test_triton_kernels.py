"""The Triton kernels (KV store, paged decode) and the xformers backend's wiring, on CPU.

Triton's interpreter runs kernels on CPU tensors when TRITON_INTERPRET=1 is set
*before triton.language is first imported*: the flag is read when `@triton.jit`
runs, and triton's own library (tl.zeros, tl.sum, tl.max, ...) is made of jit
functions too. So this module sets it before importing triton (it stays set for
the session; it only affects Triton code, which nothing else runs on CPU). In a
full-suite run another test module has usually imported triton already; then
these tests run in a fresh process (`test_in_a_fresh_interpreter_process`). On
a machine with a GPU this file runs only when TRITON_INTERPRET=1 is set
explicitly: test_gpu.py tests the compiled kernels there.

The interpreter is slow: shapes are small. Two interpreter gaps the kernels
avoid: bf16 `tl.dot` operands (upcast to fp32 in-kernel) and fp32->bf16 casts,
which it truncates (the store wrapper casts with torch).
"""

import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("a GPU is present: test_gpu.py tests the compiled kernels (TRITON_INTERPRET=1 runs these)",
                allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from helpers import make_view  # noqa: E402
from helpers import naive_attention as naive  # noqa: E402

from encdec_engine.attention.backends.base import store_kv  # noqa: E402
from encdec_engine.attention.backends.torch_sdpa import TorchSDPABackend  # noqa: E402
from encdec_engine.quantization.kv_int8 import dequantize_kv, quantize_kv, row_width  # noqa: E402
from encdec_engine.attention.metadata import AttentionMetadata  # noqa: E402
from encdec_engine.attention.ops import kv_store, paged_attention  # noqa: E402
from encdec_engine.worker.input_prep import pad_rows  # noqa: E402

# Both triton's library and our kernels must have been defined under the flag.
INTERPRETED = paged_attention.INTERPRETED and isinstance(tl.zeros, InterpretedFunction)
FRESH_PROCESS_TEST = "test_in_a_fresh_interpreter_process"


@pytest.fixture(autouse=True)
def _needs_interpreter(request):
    if not INTERPRETED and request.node.name != FRESH_PROCESS_TEST:
        pytest.skip(f"triton was imported before TRITON_INTERPRET=1: covered by {FRESH_PROCESS_TEST}")


@pytest.mark.integration  # a subprocess of the engine
@pytest.mark.skipif(INTERPRETED, reason="this process already interprets Triton kernels")
def test_in_a_fresh_interpreter_process():
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                            cwd=root, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert " passed" in summary and ", 1 skipped" in summary, summary  # only the fresh-process test skips


def paged_cache(k_lens, num_kv_heads, head_dim, block_size, dtype, rng, spare_blocks=3):
    """Contexts stored at shuffled blocks; returns cache, block tables, and each context's K/V
    (for an int8 cache: the stored values, dequantized)."""
    num_blocks = sum(-(-n // block_size) for n in k_lens) + spare_blocks
    shape = (2, num_blocks + 1, block_size, num_kv_heads, row_width(head_dim, dtype))
    if dtype == torch.int8:  # garbage in unused slots, scales included
        cache = torch.randint(-127, 128, shape, dtype=torch.int8)
    else:
        cache = torch.randn(shape).to(dtype)
    cache[:, 0] = 0
    free = list(rng.permutation(np.arange(1, num_blocks + 1)))
    tables, ks, vs = [], [], []
    for n in k_lens:
        table = [int(free.pop()) for _ in range(-(-n // block_size))]
        k, v = torch.randn(n, num_kv_heads, head_dim), torch.randn(n, num_kv_heads, head_dim)
        if dtype == torch.int8:
            k, v = (dequantize_kv(quantize_kv(x), head_dim) for x in (k, v))  # what the cache holds
        else:
            k, v = k.to(dtype), v.to(dtype)
        pos = np.arange(n)
        store_kv(k, v, cache, torch.tensor(np.array(table)[pos // block_size] * block_size + pos % block_size))
        tables.append(table)
        ks.append(k)
        vs.append(v)
    return cache, torch.from_numpy(pad_rows(tables)), ks, vs


# -- KV store ----------------------------------------------------------------------
@pytest.mark.parametrize("cache_dtype,kv_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                  (torch.float16, torch.float16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(3, 12), (1, 16)])
def test_store_kv_matches_reference(cache_dtype, kv_dtype, num_kv_heads, head_dim):
    torch.manual_seed(0)
    block_size, num_blocks, num_tokens = 4, 9, 23
    # Unordered slots across blocks 1..num_blocks (block 0 is padding).
    slots = (torch.randperm(num_blocks * block_size)[:num_tokens] + block_size).to(torch.int64)
    fused = torch.randn(num_tokens, 2, num_kv_heads, head_dim).to(kv_dtype)
    key, value = fused[:, 0], fused[:, 1]  # non-contiguous, as when split from a fused projection
    expected = torch.zeros(2, num_blocks + 1, block_size, num_kv_heads, head_dim, dtype=cache_dtype)
    got = expected.clone()
    store_kv(key, value, expected, slots)
    kv_store.store_kv_triton(key, value, got, slots.to(torch.int32))
    assert torch.equal(got, expected)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(3, 12), (1, 64), (2, 100)])  # partial, 1 full, 1 + partial
def test_store_kv_int8_matches_torch_quantization(kv_dtype, num_kv_heads, head_dim):
    """The Triton store quantizes exactly as `quantize_kv`: same int8 values, same scale bytes."""
    torch.manual_seed(1)
    block_size, num_blocks, num_tokens = 4, 9, 23
    slots = (torch.randperm(num_blocks * block_size)[:num_tokens] + block_size).to(torch.int64)
    fused = (torch.randn(num_tokens, 2, num_kv_heads, head_dim) * 3).to(kv_dtype)
    fused[0, :, 0] = 0  # an all-zero head: scale 1, values 0
    key, value = fused[:, 0], fused[:, 1]
    expected = torch.zeros(2, num_blocks + 1, block_size, num_kv_heads, row_width(head_dim, torch.int8),
                           dtype=torch.int8)
    got = expected.clone()
    store_kv(key, value, expected, slots)
    kv_store.store_kv_triton(key, value, got, slots.to(torch.int32))
    assert torch.equal(got, expected)
    # and the rows read back as the values, to within half a quantization step per group
    back = dequantize_kv(expected[0].view(-1, num_kv_heads, expected.shape[-1])[slots], head_dim)
    step = key.float().abs().amax(-1, keepdim=True) / 127
    assert ((back - key.float()).abs() <= step / 2 + 1e-6).all()


def test_store_kv_skips_negative_slots():
    cache = torch.zeros(2, 4, 2, 2, 8)
    key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([7, -1, 2, -1, 4])
    kv_store.store_kv_triton(key, value, cache, slots)
    expected = torch.zeros_like(cache)
    store_kv(key[[0, 2, 4]], value[[0, 2, 4]], expected, slots[[0, 2, 4]])
    assert torch.equal(cache, expected)  # the skipped tokens went nowhere (slot -1 is not the last slot)


def test_store_kv_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="do not match"):
        kv_store.store_kv_triton(torch.zeros(3, 2, 8), torch.zeros(3, 2, 8), torch.zeros(2, 4, 2, 1, 8),
                                     torch.tensor([1, 2, 3]))


# -- paged decode ------------------------------------------------------------------
DECODE_CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, key_lens)
    (4, 4, 16, 4, [1, 4, 13, 29]),  # MHA, contexts of 1 key and > 3 blocks
    (6, 2, 12, 4, [1, 17, 70]),  # GQA group 3 (padded), head_dim 12 (padded), 70 keys: several tiles
    (4, 1, 8, 8, [33, 2, 64]),  # MQA, head_dim 8 (padded to 16)
]
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
             torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", DECODE_CASES)
def test_paged_decode_matches_torch_backend_and_naive(case, dtype):
    num_heads, num_kv_heads, head_dim, block_size, k_lens = case
    torch.manual_seed(len(k_lens))
    cache, tables, ks, vs = paged_cache(k_lens, num_kv_heads, head_dim, block_size, dtype,
                                        np.random.default_rng(sum(k_lens)))
    scale = head_dim**-0.5
    q = torch.randn(len(k_lens), num_heads, head_dim).to(dtype)
    out = paged_attention.paged_decode_attention(q, cache, tables, torch.tensor(k_lens), scale, block_size,
                                           max_key_len=max(k_lens), partition_size=None)
    assert out.dtype == dtype and out.shape == q.shape
    ref = torch.cat([naive(q[i : i + 1], ks[i], vs[i], scale) for i in range(len(k_lens))])
    torch.testing.assert_close(out.double(), ref, **TOLERANCE[dtype])
    if dtype == torch.bfloat16:
        return  # torch's CPU SDPA on bf16 rounds its intermediates; the fp64 reference is the better judge
    view = make_view([1] * len(k_lens), k_lens, True, block_tables=tables)
    backend = TorchSDPABackend(block_size)
    backend.plan(AttentionMetadata(decoder=view, block_size=block_size))
    torch.testing.assert_close(out, backend.forward(q, None, None, cache, view, scale), **TOLERANCE[dtype])


@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", DECODE_CASES + [(4, 2, 64, 16, [1, 200, 45]), (2, 1, 100, 8, [3, 70])])
def test_paged_decode_int8_cache_matches_dequantized_reference(case, query_dtype):
    """int8 cache: the kernel equals attention over the dequantized K/V (up to float rounding), one pass
    and split into partitions, and the torch backend's int8 path agrees."""
    num_heads, num_kv_heads, head_dim, block_size, k_lens = case
    torch.manual_seed(len(k_lens) + 1)
    cache, tables, ks, vs = paged_cache(k_lens, num_kv_heads, head_dim, block_size, torch.int8,
                                        np.random.default_rng(sum(k_lens) + 1))
    scale = head_dim**-0.5
    q = torch.randn(len(k_lens), num_heads, head_dim).to(query_dtype)
    ref = torch.cat([naive(q[i : i + 1], ks[i], vs[i], scale) for i in range(len(k_lens))])
    tol = TOLERANCE[query_dtype]
    for partition_size in (None, 32):
        out = paged_attention.paged_decode_attention(q, cache, tables, torch.tensor(k_lens), scale, block_size,
                                                     max_key_len=max(k_lens), partition_size=partition_size)
        assert out.dtype == query_dtype and out.shape == q.shape
        torch.testing.assert_close(out.double(), ref, **tol)
    view = make_view([1] * len(k_lens), k_lens, True, block_tables=tables)
    backend = TorchSDPABackend(block_size)
    backend.plan(AttentionMetadata(decoder=view, block_size=block_size))
    torch.testing.assert_close(backend.forward(q, None, None, cache, view, scale).double(), ref, **tol)


@pytest.mark.parametrize("kind", ["t5", "alibi"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("partition_size", [None, 32])
def test_paged_decode_adds_a_position_bias(kind, cache_dtype, partition_size):
    """T5 buckets and ALiBi slopes through the kernel's bias table: naive attention with the bias written
    out per key, and the torch backend's."""
    from encdec_engine.attention.position_bias import alibi_bias, alibi_slopes, t5_bucket_index, t5_position_bias

    num_heads, num_kv_heads, head_dim, block_size, k_lens = 6, 2, 12, 4, [1, 17, 70, 33]
    torch.manual_seed(11)
    if kind == "t5":
        index, low = t5_bucket_index(False, 8, 20)
        bias = t5_position_bias(torch.randn(8, num_heads), index, low)
    else:
        bias = alibi_bias(alibi_slopes(num_heads), 128)
    cache, tables, ks, vs = paged_cache(k_lens, num_kv_heads, head_dim, block_size, cache_dtype,
                                        np.random.default_rng(11))
    scale = head_dim**-0.5
    q = torch.randn(len(k_lens), num_heads, head_dim)
    out = paged_attention.paged_decode_attention(q, cache, tables, torch.tensor(k_lens), scale, block_size,
                                                 max_key_len=max(k_lens), partition_size=partition_size,
                                                 position_bias=bias)
    for i, n in enumerate(k_lens):
        mask = bias.block(1, n)[:, 0]  # [H, n]: the query is the last key
        rep = num_heads // num_kv_heads
        k, v = ks[i].double().repeat_interleave(rep, 1), vs[i].double().repeat_interleave(rep, 1)
        scores = torch.einsum("hd,khd->hk", q[i].double(), k) * scale + mask.double()
        ref = torch.einsum("hk,khd->hd", scores.softmax(-1), v)
        torch.testing.assert_close(out[i].double(), ref, rtol=1e-5, atol=1e-5)
    view = make_view([1] * len(k_lens), k_lens, True, block_tables=tables)
    backend = TorchSDPABackend(block_size)
    backend.plan(AttentionMetadata(decoder=view, block_size=block_size))
    torch.testing.assert_close(out, backend.forward(q, None, None, cache, view, scale, bias), rtol=1e-5, atol=1e-5)


def spare_capacity_case(k_lens, block_size: int, spare_columns: int, seed: int, head_dim: int = 16):
    """fp32 cache, tables with `spare_columns` unused columns (a CUDA graph's capacity), 4 query heads on 2."""
    torch.manual_seed(seed)
    cache, tables, ks, vs = paged_cache(k_lens, 2, head_dim, block_size, torch.float32, np.random.default_rng(seed))
    tables = torch.cat([tables, torch.zeros(len(k_lens), spare_columns, dtype=tables.dtype)], 1)
    return cache, tables, ks, vs, torch.randn(len(k_lens), 4, head_dim)


@pytest.mark.parametrize("max_key_len", [None, 96])  # None: the tables' capacity (CUDA-graph style)
def test_split_k_partitions_merge_exactly(max_key_len):
    head_dim, block_size, k_lens = 16, 8, [1, 40, 96, 65]
    cache, tables, ks, vs, q = spare_capacity_case(k_lens, block_size, spare_columns=4, seed=7)
    args = (q, cache, tables, torch.tensor(k_lens, dtype=torch.int32), head_dim**-0.5, block_size)
    one_pass = paged_attention.paged_decode_attention(*args, max_key_len=max_key_len, partition_size=None)
    split = paged_attention.paged_decode_attention(*args, max_key_len=max_key_len, partition_size=32)
    torch.testing.assert_close(split, one_pass, rtol=1e-5, atol=1e-6)
    ref = torch.cat([naive(q[i : i + 1], ks[i], vs[i], head_dim**-0.5) for i in range(len(k_lens))])
    torch.testing.assert_close(split.double(), ref, rtol=1e-5, atol=1e-5)


def test_empty_context_gives_zeros_and_bad_shapes_are_refused():
    cache = torch.randn(2, 3, 4, 1, 16)
    q = torch.randn(2, 2, 16)
    tables, lens = torch.tensor([[1], [2]]), torch.tensor([0, 3])
    out = paged_attention.paged_decode_attention(q, cache, tables, lens, 0.25, 4, partition_size=None)
    assert torch.equal(out[0], torch.zeros(2, 16)) and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="multiple"):
        paged_attention.paged_decode_attention(torch.randn(2, 3, 16), torch.randn(2, 3, 4, 2, 16), tables, lens, 1.0, 4)
    with pytest.raises(ValueError, match="block_size"):
        paged_attention.paged_decode_attention(q, cache, tables, lens, 1.0, 8)


def test_partitioning_depends_on_the_context_length_only():
    choose = paged_attention.default_partition_size
    assert choose(max_key_len=1500) == 512  # a Whisper cross cache
    assert choose(max_key_len=512) is None and choose(max_key_len=448) is None


def test_a_sequence_decodes_to_the_same_bits_in_any_batch():
    """Alone, in a batch, and padded to the tables' capacity (a CUDA graph's call): bitwise equal."""
    block_size, k_lens = 16, [700, 300, 1100, 512]
    cache, tables, _, _, q = spare_capacity_case(k_lens, block_size, spare_columns=40, seed=9)
    lens = torch.tensor(k_lens)

    def decode(rows, max_key_len):
        return paged_attention.paged_decode_attention(q[rows], cache, tables[rows], lens[rows], 0.25, block_size,
                                                      max_key_len=max_key_len)

    batch = decode(slice(None), max(k_lens))
    padded = decode(slice(None), None)  # capacity: more (empty) partitions
    assert torch.equal(batch, padded)
    for i, n in enumerate(k_lens):
        assert torch.equal(decode(slice(i, i + 1), n), batch[i : i + 1]), n  # 300, 512: one pass alone


# -- the xformers backend's wiring, with a reference standing in for the CUDA flash op --
def reference_flash(q, k, v, attn_bias, scale):
    """What xformers' flash op computes, from the materialized bias ([1, T, (G,) H, D] layouts)."""
    T, Tk = q.shape[1], k.shape[1]
    q3, k3, v3 = (x[0].reshape(x.shape[1], -1, x.shape[-1]) for x in (q, k, v))
    out = naive(q3, k3, v3, scale, attn_bias.materialize((T, Tk)))
    return out.to(q.dtype).reshape(q.shape)


@pytest.fixture
def backend(monkeypatch):
    from encdec_engine.attention.backends.xformers_backend import XFormersBackend

    b = XFormersBackend.__new__(XFormersBackend)  # skip the CUDA check: kernels run interpreted
    b._init(4)
    monkeypatch.setattr(b, "_flash_unsupported", lambda *a: "")
    monkeypatch.setattr(b, "_flash_forward", reference_flash)
    return b


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_backend_prefill_decode_and_store_match_torch_backend(backend, num_kv_heads, cache_dtype):
    torch.manual_seed(3)
    H, D, BS = 4, 8, 4
    scale = D**-0.5
    torch_backend = TorchSDPABackend(BS)
    # Prefill: fresh decoder self-attention over three sequences, stored into the cache.
    q_lens = [3, 9, 1]
    tables = torch.from_numpy(pad_rows([[5, 2, 7], [1, 3, 4, 6], [8]]))
    pos = [np.arange(n) for n in q_lens]
    slots = torch.from_numpy(np.concatenate([tables[i].numpy()[p // BS] * BS + p % BS for i, p in enumerate(pos)]))
    k_start = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).tolist()
    view = make_view(q_lens, q_lens, True, slot_mapping=slots, key_start_loc=k_start)
    q, k, v = torch.randn(13, H, D), torch.randn(13, num_kv_heads, D), torch.randn(13, num_kv_heads, D)
    caches = [torch.zeros(2, 9, BS, num_kv_heads, row_width(D, cache_dtype), dtype=cache_dtype) for _ in range(2)]
    backend.plan(AttentionMetadata(decoder=view, block_size=BS))
    out = backend.forward(q, k, v, caches[0], view, scale)
    ref = torch_backend.forward(q, k, v, caches[1], make_view(q_lens, q_lens, True, slot_mapping=slots,
                                                              key_start_loc=k_start), scale)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(caches[0], caches[1])
    # Decode: one new token per sequence, stored then read through the block tables.
    lens = [n + 1 for n in q_lens]
    new_slots = torch.tensor([int(tables[i, (n - 1) // BS]) * BS + (n - 1) % BS for i, n in enumerate(lens)])
    q, k, v = torch.randn(3, H, D), torch.randn(3, num_kv_heads, D), torch.randn(3, num_kv_heads, D)
    outs = []
    for b, cache in zip((backend, torch_backend), caches):
        view = make_view([1, 1, 1], lens, True, slot_mapping=new_slots, block_tables=tables)
        b.plan(AttentionMetadata(decoder=view, block_size=BS))
        outs.append(b.forward(q, k, v, cache, view, scale))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    assert torch.equal(caches[0], caches[1])


def test_backend_cross_prefill_with_shared_encoder_segments(backend):
    """Two sequences of one group attend to the same encoder segment: K/V rows are expanded."""
    torch.manual_seed(4)
    H, D = 2, 8
    enc_lens, q_lens = [5, 3], [2, 4, 3]
    k_start = [0, 0, 5]  # sequences 0 and 1 share group 0's encoder output
    view = make_view(q_lens, [5, 5, 3], False, key_start_loc=k_start)
    q, k, v = torch.randn(9, H, D), torch.randn(sum(enc_lens), H, D), torch.randn(sum(enc_lens), H, D)
    backend.plan(AttentionMetadata(decoder=view, cross=view))
    out = backend.forward(q, k, v, None, view, D**-0.5)
    ref = TorchSDPABackend(4).forward(q, k, v, None, make_view(q_lens, [5, 5, 3], False, key_start_loc=k_start),
                                      D**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8])
def test_backend_prefill_over_cached_prefix(backend, cache_dtype):
    torch.manual_seed(5)
    H, D, BS = 4, 8, 4
    q_lens, k_lens = [2, 3, 1], [6, 3, 9]
    cache, tables, ks, vs = paged_cache(k_lens, 2, D, BS, cache_dtype, np.random.default_rng(5))
    view = make_view(q_lens, k_lens, True, block_tables=tables)
    backend.plan(AttentionMetadata(decoder=view, block_size=BS))
    q = torch.randn(6, H, D)
    out = backend.forward(q, None, None, cache, view, D**-0.5)
    ref = TorchSDPABackend(BS).forward(q, None, None, cache, make_view(q_lens, k_lens, True, block_tables=tables),
                                       D**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_backend_takes_a_position_bias_in_prefill_and_decode(backend, caplog):
    """Prefill with a bias runs on torch SDPA (the flash op takes none), saying so once; decode reads the
    bias table in the Triton kernel. Both equal the torch backend."""
    from encdec_engine.attention.position_bias import t5_bucket_index, t5_position_bias

    torch.manual_seed(6)
    H, D, BS = 4, 8, 4
    index, low = t5_bucket_index(False, 8, 10)
    bias = t5_position_bias(torch.randn(8, H), index, low)
    q_lens = [3, 9, 1]
    tables = torch.from_numpy(pad_rows([[5, 2, 7], [1, 3, 4, 6], [8]]))
    pos = [np.arange(n) for n in q_lens]
    slots = torch.from_numpy(np.concatenate([tables[i].numpy()[p // BS] * BS + p % BS for i, p in enumerate(pos)]))
    k_start = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).tolist()
    q, k, v = torch.randn(13, H, D), torch.randn(13, H, D), torch.randn(13, H, D)
    caches = [torch.zeros(2, 9, BS, H, D) for _ in range(2)]
    outs = []
    with caplog.at_level(logging.WARNING):
        for b, cache in zip((backend, TorchSDPABackend(BS)), caches):
            view = make_view(q_lens, q_lens, True, slot_mapping=slots, key_start_loc=k_start)
            b.plan(AttentionMetadata(decoder=view, block_size=BS))
            outs.append(b.forward(q, k, v, cache, view, 1.0, bias))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    assert torch.equal(caches[0], caches[1])
    assert "position bias" in caplog.text
    lens = [n + 1 for n in q_lens]
    new_slots = torch.tensor([int(tables[i, (n - 1) // BS]) * BS + (n - 1) % BS for i, n in enumerate(lens)])
    q, k, v = torch.randn(3, H, D), torch.randn(3, H, D), torch.randn(3, H, D)
    outs = []
    for b, cache in zip((backend, TorchSDPABackend(BS)), caches):
        view = make_view([1, 1, 1], lens, True, slot_mapping=new_slots, block_tables=tables)
        b.plan(AttentionMetadata(decoder=view, block_size=BS))
        outs.append(b.forward(q, k, v, cache, view, 1.0, bias))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_backend_falls_back_to_torch_explicitly_and_logs_once(caplog):
    from encdec_engine.attention.backends.xformers_backend import XFormersBackend

    b = XFormersBackend.__new__(XFormersBackend)
    b._init(4)  # the real flash check: it refuses CPU tensors, so prefill goes to torch SDPA
    view = make_view([3, 2], [3, 2], True, key_start_loc=[0, 3])
    q, k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    with caplog.at_level(logging.WARNING, logger="encdec_engine.attention.backends.xformers_backend"):
        for _ in range(3):
            b.plan(AttentionMetadata(decoder=view))
            out = b.forward(q, k, v, None, view, 0.3)
    fallbacks = [r for r in caplog.records if "using torch SDPA" in r.getMessage()]
    assert len(fallbacks) == 1 and "prefill" in fallbacks[0].getMessage()
    ref = TorchSDPABackend(4).forward(q, k, v, None, make_view([3, 2], [3, 2], True, key_start_loc=[0, 3]), 0.3)
    torch.testing.assert_close(out, ref)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_xformers_backend_needs_cuda_with_a_clear_error():
    from encdec_engine.attention.backends.xformers_backend import XFormersBackend
    from encdec_engine.config import EngineConfig
    from encdec_engine.engine.loader import make_backend

    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        XFormersBackend(16)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        make_backend(EngineConfig(model="unused", attention_backend="xformers"), torch.device("cpu"))
    assert isinstance(make_backend(EngineConfig(model="unused"), torch.device("cpu")), TorchSDPABackend)


# -- decode through the CUDA-graph buffers (padded fixed-size batches), eagerly ----------
def interpreted_xformers_engine(path: Path):
    """A fresh CPU engine whose attention layers all use the xformers backend: prefill falls
    back to torch SDPA (flash refuses CPU tensors), decode and stores run the interpreted kernels."""
    from encdec_engine import LLM
    from encdec_engine.attention.backends.xformers_backend import XFormersBackend
    from encdec_engine.attention.layer import Attention

    llm = LLM(model=str(path), num_kv_blocks=120)
    backend = XFormersBackend.__new__(XFormersBackend)
    backend._init(llm.engine.config.block_size)
    for module in llm.engine.model.modules():
        if isinstance(module, Attention):
            module.backend = backend
    llm.engine.runner.backend = backend
    return llm


@pytest.mark.parametrize("config", ["small", "odd_heads"])
def test_padded_graph_decode_matches_eager_decode_and_hf(config, bart_paths, make_llm):
    from transformers import BartForConditionalGeneration

    from encdec_engine import SamplingParams
    from helpers import hf_greedy, mixed_prompts

    path = bart_paths[config]
    llm = interpreted_xformers_engine(path)
    engine = llm.engine
    engine.runner.use_decode_graphs([1, 2, 4], engine.max_decoder_len,
                                    engine.model.encoder_num_positions(engine.model.max_encoder_len), capture=False)
    prompts = mixed_prompts(llm.get_tokenizer(), n=6, seed=5)
    max_tokens = [2, 9, 5, 12, 3, 7]  # the batch shrinks 6 -> 1: eager above 4, then buckets 4, 2, 1
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    eager = make_llm(path).generate(prompts, params, use_tqdm=False)  # the torch backend, unpadded
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in eager]
    hf = BartForConditionalGeneration.from_pretrained(path).eval()
    ref = [hf_greedy(hf, o.encoder_prompt_token_ids, o.prompt_token_ids, m) for o, m in zip(outs, max_tokens)]
    assert [o.outputs[0].token_ids for o in outs] == ref
    graph_steps, decode_steps = engine.runner.graph_steps, engine.stats["decode_steps"]
    assert 0 < graph_steps < decode_steps, (graph_steps, decode_steps)  # both paths ran
    assert engine.num_free_blocks() == engine.num_total_blocks()


def test_padding_rows_store_nothing(bart_path):
    """One real sequence in a batch of 4: its K/V land in its slot, and nothing else in any cache changes."""
    from encdec_engine.worker.input_prep import DecodeBatch

    llm = interpreted_xformers_engine(bart_path)
    engine = llm.engine
    runner = engine.runner
    runner.use_decode_graphs([4], engine.max_decoder_len, 64, capture=False)
    bs = engine.config.block_size
    for cache in runner.cache.kv_caches:
        cache.normal_()
    before = [c.clone() for c in runner.cache.kv_caches]
    seq_len = bs + 3  # the new token at position bs + 2, in the second block
    batch = DecodeBatch(input_ids=np.array([7]), positions=np.array([seq_len - 1]),
                        slot_mapping=np.array([9 * bs + 2]), block_tables=np.array([[5, 9]]),
                        seq_lens=np.array([seq_len]), cross_block_tables=np.array([[11, 12]]),
                        encoder_lens=np.array([20]))
    out = runner.graphs.run(batch)
    assert out.shape[0] == 1 and torch.isfinite(out).all()
    for old, new in zip(before, runner.cache.kv_caches):
        changed = (old != new).any(-1).any(-1)  # [2, num_blocks, block_size]
        assert changed.nonzero().tolist() == [[0, 9, 2], [1, 9, 2]]


def test_padded_graph_decode_of_a_decoder_only_model(tmp_path):
    """No encoder: the static batch has no cross view (Llama with GQA, RoPE)."""
    from helpers import causal_prompts, hf_causal_greedy
    from transformers import LlamaForCausalLM

    from encdec_engine import SamplingParams
    from helpers import make_bart_tokenizer, make_causal_lm

    tokenizer = make_bart_tokenizer(tmp_path / "tokenizer")
    path = make_causal_lm(tmp_path / "llama", tokenizer, "llama", "gqa")
    llm = interpreted_xformers_engine(path)
    engine = llm.engine
    engine.runner.use_decode_graphs([1, 2], engine.max_decoder_len, None, capture=False)
    assert engine.runner.graphs.metadata[2].cross is None
    prompts = causal_prompts(len(tokenizer), n=5, seed=4)
    max_tokens = [3, 8, 5, 2, 6]
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens],
                        use_tqdm=False)
    hf = LlamaForCausalLM.from_pretrained(path).eval()
    assert [o.outputs[0].token_ids for o in outs] == [hf_causal_greedy(hf, o.prompt_token_ids, m)
                                                      for o, m in zip(outs, max_tokens)]
    assert 0 < engine.runner.graph_steps < engine.stats["decode_steps"]
    assert engine.num_free_blocks() == engine.num_total_blocks()
