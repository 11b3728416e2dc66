"""The torch backend against naive attention under xformers' materialized block-diagonal masks."""

import numpy as np
import pytest
import torch
from helpers import make_view, naive_attention

from encdec_engine.attention.backends.base import store_kv
from encdec_engine.attention.backends.cpu_copies import HEAD_MAJOR_BUDGET
from encdec_engine.attention.backends.torch_sdpa import TorchSDPABackend
from encdec_engine.attention.backends.xformers_masks import prefill_attn_bias
from encdec_engine.attention.metadata import AttentionMetadata
from encdec_engine.layers.linear import bf16_native
from encdec_engine.worker.input_prep import pad_rows

H, D, BS = 4, 8, 4
SCALE = D**-0.5


def naive(q, k, v, mask, num_kv_heads):
    # q: [T, H, D], k/v: [Tk, Hkv, D], mask: [T, Tk] additive
    rep = q.shape[1] // num_kv_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("thd,khd->htk", q, k) * SCALE + mask
    return torch.einsum("htk,khd->thd", scores.softmax(-1), v)


@pytest.mark.parametrize("num_kv_heads", [H, 2])
@pytest.mark.parametrize("kind", ["encoder", "decoder", "cross"])
def test_fresh_prefill_matches_block_diagonal_mask(kind, num_kv_heads):
    torch.manual_seed(0)
    q_lens = [3, 1, 5, 5, 2]
    k_lens = {"encoder": q_lens, "decoder": q_lens, "cross": [7, 2, 4, 6, 9]}[kind]
    causal = kind == "decoder"
    k_start = np.concatenate([[0], np.cumsum(k_lens)[:-1]]).tolist()
    v_ = make_view(q_lens, k_lens, causal, key_start_loc=k_start)
    q = torch.randn(sum(q_lens), H, D)
    k, v = torch.randn(sum(k_lens), num_kv_heads, D), torch.randn(sum(k_lens), num_kv_heads, D)
    out = TorchSDPABackend(BS).forward(q, k, v, None, v_, SCALE)
    mask = prefill_attn_bias(v_).materialize((sum(q_lens), sum(k_lens)))
    torch.testing.assert_close(out, naive(q, k, v, mask, num_kv_heads), rtol=1e-5, atol=1e-5)


def paged(k_lens, num_kv_heads, rng):
    """Random contexts stored in a paged cache at shuffled blocks; returns cache, tables, contexts."""
    num_blocks = sum(-(-n // BS) for n in k_lens) + 3
    cache = torch.zeros(2, num_blocks + 1, BS, num_kv_heads, D)
    free = list(rng.permutation(np.arange(1, num_blocks + 1)))
    tables, ks, vs = [], [], []
    for n in k_lens:
        table = [int(free.pop()) for _ in range(-(-n // BS))]
        k, v = torch.randn(n, num_kv_heads, D), torch.randn(n, num_kv_heads, D)
        pos = np.arange(n)
        slots = torch.tensor(np.array(table)[pos // BS] * BS + pos % BS)
        store_kv(k, v, cache, slots)
        tables.append(table)
        ks.append(k)
        vs.append(v)
    return cache, tables, ks, vs


@pytest.mark.parametrize("num_kv_heads", [H, 1])
@pytest.mark.parametrize("causal", [True, False])
def test_paged_decode_matches_naive(causal, num_kv_heads):
    torch.manual_seed(1)
    rng = np.random.default_rng(1)
    k_lens = [1, 9, 4, 17]
    cache, tables, ks, vs = paged(k_lens, num_kv_heads, rng)
    v_ = make_view([1] * 4, k_lens, causal, block_tables=torch.from_numpy(pad_rows(tables)))
    backend = TorchSDPABackend(BS)
    backend.plan(AttentionMetadata(decoder=v_))
    q = torch.randn(4, H, D)
    out = backend.forward(q, None, None, cache, v_, SCALE)
    for i in range(4):
        ref = naive(q[i : i + 1], ks[i], vs[i], torch.zeros(1, k_lens[i]), num_kv_heads)
        torch.testing.assert_close(out[i : i + 1], ref, rtol=1e-5, atol=1e-5)


def test_prefill_over_cached_prefix_is_bottom_right_causal():
    torch.manual_seed(2)
    rng = np.random.default_rng(2)
    q_lens, k_lens = [2, 3, 1], [5, 3, 8]
    cache, tables, ks, vs = paged(k_lens, H, rng)
    v_ = make_view(q_lens, k_lens, True, block_tables=torch.from_numpy(pad_rows(tables)))
    q = torch.randn(sum(q_lens), H, D)
    out = TorchSDPABackend(BS).forward(q, None, None, cache, v_, SCALE)
    mask = prefill_attn_bias(v_).materialize((sum(q_lens), sum(k_lens)))
    ref = naive(q, torch.cat(ks), torch.cat(vs), mask, H)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_store_kv_writes_exact_slots():
    cache = torch.zeros(2, 4, BS, 1, 2)
    k = torch.arange(6.0).view(3, 1, 2)
    store_kv(k, -k, cache, torch.tensor([5, 6, 13]))
    flat = cache[0].view(-1, 1, 2)
    assert torch.equal(flat[[5, 6, 13]], k) and torch.equal(cache[1].view(-1, 1, 2)[[5, 6, 13]], -k)
    assert cache[:, 0].abs().sum() == 0  # padding block untouched


@pytest.mark.parametrize("contiguous,dtype", [(True, torch.float32), (False, torch.float32), (True, torch.bfloat16)])
def test_long_contexts_read_in_place_when_contiguous(contiguous, dtype):
    from encdec_engine.attention.backends.torch_sdpa import GatherPlan, SlicePlan

    torch.manual_seed(3)
    k_lens = [130, 257, 140]
    tables, start = [], 1
    for n in k_lens:
        tables.append(list(range(start, start + -(-n // BS))))
        start += len(tables[-1])
    if not contiguous:
        tables[1][3], tables[1][4] = tables[1][4], tables[1][3]
    cache = torch.zeros(2, start, BS, 2, D, dtype=dtype)
    ks, vs = [], []
    for n, table in zip(k_lens, tables):
        k, v = torch.randn(n, 2, D).to(dtype), torch.randn(n, 2, D).to(dtype)
        pos = np.arange(n)
        store_kv(k, v, cache, torch.tensor(np.array(table)[pos // BS] * BS + pos % BS))
        ks.append(k)
        vs.append(v)
    v_ = make_view([1, 1, 1], k_lens, False, block_tables=torch.from_numpy(pad_rows(tables)))
    backend = TorchSDPABackend(BS)
    backend.plan(AttentionMetadata(decoder=v_))
    assert isinstance(v_.plan, SlicePlan if contiguous else GatherPlan)
    q = torch.randn(3, H, D).to(dtype)
    out = backend.forward(q, None, None, cache, v_, SCALE)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i in range(3):
        ref = naive(q[i : i + 1].float(), ks[i].float(), vs[i].float(), torch.zeros(1, k_lens[i]), 2)
        torch.testing.assert_close(out[i : i + 1].float(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("num_kv_heads", [H, 2])
def test_sequences_sharing_a_context_read_it_once_and_get_their_own_attention(num_kv_heads, monkeypatch):
    """The beams (or best_of samples) of a request share its cross cache: one matmul over their stacked
    queries, whose rows equal each sequence's attention alone."""
    from encdec_engine.attention.backends.torch_sdpa import SlicePlan

    torch.manual_seed(5)
    length = 300
    table = list(range(1, 1 + -(-length // BS)))
    cache = torch.zeros(2, 2 + len(table), BS, num_kv_heads, D)
    k, v = torch.randn(length, num_kv_heads, D), torch.randn(length, num_kv_heads, D)
    pos = np.arange(length)
    store_kv(k, v, cache, torch.tensor(np.array(table)[pos // BS] * BS + pos % BS))
    shared = make_view([1] * 4, [length] * 4, False, block_tables=torch.tensor([table] * 4))
    backend = TorchSDPABackend(BS)
    backend.plan(AttentionMetadata(decoder=None, cross=shared))
    assert isinstance(shared.plan, SlicePlan) and len(set(shared.plan.starts)) == 1
    q = torch.randn(4, H, D)
    calls = []
    for name in ("bmm", "matmul"):  # the pool's context, or its head-major copy in a slab
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda a, b, real=real, **kw: calls.append(a.shape) or real(a, b, **kw))
    out = backend.forward(q, None, None, cache, shared, SCALE)
    monkeypatch.undo()
    assert len(calls) == 2  # scores and values, once for all four sequences
    for i in range(4):
        ref = naive(q[i : i + 1], k, v, torch.zeros(1, length), num_kv_heads)
        torch.testing.assert_close(out[i : i + 1], ref, rtol=1e-5, atol=1e-5)
        alone = make_view([1], [length], False, block_tables=torch.tensor([table]))
        backend.plan(AttentionMetadata(decoder=None, cross=alone))
        torch.testing.assert_close(out[i : i + 1], backend.forward(q[i : i + 1], None, None, cache, alone, SCALE),
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_uniform_segments_take_the_reshape_path(causal):
    torch.manual_seed(4)
    lens = [6, 6, 6]
    v_ = make_view(lens, lens, causal, key_start_loc=[0, 6, 12])
    q, k, v = torch.randn(18, H, D), torch.randn(18, H, D), torch.randn(18, H, D)
    out = TorchSDPABackend(BS).forward(q, k, v, None, v_, SCALE)
    mask = prefill_attn_bias(v_).materialize((18, 18))
    torch.testing.assert_close(out, naive(q, k, v, mask, H), rtol=1e-5, atol=1e-5)


def _contiguous_context(cache, first_block: int, length: int, seed: int):
    """Random K/V for `length` positions stored from block `first_block` on; returns (k, v, slots)."""
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads = cache.shape[3]
    k, v = torch.randn(length, num_kv_heads, D, generator=gen), torch.randn(length, num_kv_heads, D, generator=gen)
    slots = torch.arange(first_block * BS, first_block * BS + length)
    store_kv(k, v, cache, slots)
    return k, v, slots


def _cross_decode(backend, cache, tables, k_lens, q):
    view = make_view([1] * len(k_lens), k_lens, False, block_tables=torch.from_numpy(pad_rows(tables)))
    backend.plan(AttentionMetadata(decoder=make_view([1], [1], True), cross=view))
    return backend.forward(q, None, None, cache, view, SCALE)


def test_cross_decode_reads_a_head_major_copy_that_follows_every_write():
    """fp32 cross contexts are read from head-major copies made at the first decode read. A copy must
    never outlive its slots' contents: a store into them (a new request's prefill on reused blocks),
    a cache-engine copy-on-write or swap-in into them, or a decode step that no longer reads the
    context drops it, and the next read sees what the pool holds."""
    from encdec_engine.models.interface import KVCacheSpec
    from encdec_engine.worker.cache_engine import CacheEngine
    from encdec_engine.worker.model_runner import ModelRunner

    length, num_kv_heads = 150, 2
    blocks = -(-length // BS)
    engine = CacheEngine(KVCacheSpec(1, num_kv_heads, D), BS, 2 * blocks + 2, 0, torch.float32, torch.device("cpu"))
    backend = TorchSDPABackend(BS)
    ModelRunner(None, backend, engine, BS, torch.device("cpu"))  # registers the backend for block writes
    cache = engine.kv_caches[0]
    table_a, table_b = list(range(1, 1 + blocks)), list(range(1 + blocks, 1 + 2 * blocks))
    q = torch.randn(1, H, D, generator=torch.Generator().manual_seed(0))

    def check(out, k, v):
        torch.testing.assert_close(out, naive(q, k, v, torch.zeros(1, length), num_kv_heads), rtol=1e-5, atol=1e-5)

    k, v, slots = _contiguous_context(cache, 1, length, seed=1)
    check(_cross_decode(backend, cache, [table_a], [length], q), k, v)
    assert len(backend.head_major.copies) == 1
    check(_cross_decode(backend, cache, [table_a], [length], q), k, v)  # read from the copy

    # A prefill storing new K/V into the context's slots (its blocks went to another request).
    backend.plan(AttentionMetadata(decoder=make_view([length], [length], True, slot_mapping=slots)))
    assert not backend.head_major.copies
    k, v, _ = _contiguous_context(cache, 1, length, seed=2)
    check(_cross_decode(backend, cache, [table_a], [length], q), k, v)

    # Copy-on-write into one of its blocks, through the cache engine (from a block holding values: the pool
    # is allocated with torch.empty, and a never-written block may hold NaNs).
    cache[:, table_b[0]] = torch.randn(cache[:, table_b[0]].shape, generator=torch.Generator().manual_seed(3))
    engine.copy([(table_b[0], table_a[3])])
    assert not backend.head_major.copies
    k[3 * BS : 4 * BS], v[3 * BS : 4 * BS] = cache[0, table_b[0]], cache[1, table_b[0]]
    check(_cross_decode(backend, cache, [table_a], [length], q), k, v)

    # A decode step that reads only another context drops this one's copy.
    kb, vb, _ = _contiguous_context(cache, 1 + blocks, length, seed=3)
    check(_cross_decode(backend, cache, [table_b], [length], q), kb, vb)
    assert [key[1] for key in backend.head_major.copies] == [table_b[0] * BS]


def test_head_major_copies_stay_within_their_budget():
    length, num_kv_heads = 150, 2
    blocks = -(-length // BS)
    cache = torch.zeros(2, 2 * blocks + 1, BS, num_kv_heads, D)
    contexts = [_contiguous_context(cache, 1 + i * blocks, length, seed=i) for i in range(2)]
    tables = [list(range(1 + i * blocks, 1 + (i + 1) * blocks)) for i in range(2)]
    backend = TorchSDPABackend(BS)
    one = backend.head_major.slot_nbytes(length, num_kv_heads, D)
    backend.head_major.budget = one  # room for one context's copy
    q = torch.randn(2, H, D, generator=torch.Generator().manual_seed(0))
    out = _cross_decode(backend, cache, tables, [length, length], q)
    assert len(backend.head_major.copies) == 1 and backend.head_major.nbytes == one
    for i, (k, v, _) in enumerate(contexts):  # the second context is read from the pool
        ref = naive(q[i : i + 1], k, v, torch.zeros(1, length), num_kv_heads)
        torch.testing.assert_close(out[i : i + 1], ref, rtol=1e-5, atol=1e-5)


def test_cross_contexts_of_one_padded_length_are_read_as_one_batch_through_every_change():
    """Contexts whose lengths round up alike share a slab (one padded matmul for all of them). Every
    sequence still gets its own context's attention as the step's set changes: a context dropped from
    the middle of a slab (the last slot moves into its place), one that comes back read by two
    sequences (another slab), and a fresh one."""
    lengths = [150, 140, 150, 40, 133]  # 150, 140, 133 -> 160 keys; 40 -> 64
    num_kv_heads = 2
    starts = np.cumsum([1] + [-(-n // BS) for n in lengths[:-1]]).tolist()
    cache = torch.zeros(2, starts[-1] + -(-lengths[-1] // BS) + 1, BS, num_kv_heads, D)
    contexts = [_contiguous_context(cache, b, n, seed=i) for i, (b, n) in enumerate(zip(starts, lengths))]
    tables = [list(range(b, b + -(-n // BS))) for b, n in zip(starts, lengths)]
    backend = TorchSDPABackend(BS)
    gen = torch.Generator().manual_seed(9)

    def step_reads(which):  # which: the context each sequence of the step reads
        q = torch.randn(len(which), H, D, generator=gen)
        out = _cross_decode(backend, cache, [tables[c] for c in which], [lengths[c] for c in which], q)
        for i, c in enumerate(which):
            k, v, _ = contexts[c]
            ref = naive(q[i : i + 1], k, v, torch.zeros(1, lengths[c]), num_kv_heads)
            torch.testing.assert_close(out[i : i + 1], ref, rtol=1e-5, atol=1e-5)

    def slab_counts():
        return sorted((length, readers, len(slab.contexts)) for (_, length, readers), slab in backend.head_major.slabs.items())

    with torch.inference_mode():  # as the engine's forwards run: the slabs are inference tensors
        step_reads([0, 1, 2, 3])
    assert slab_counts() == [(64, 1, 1), (160, 1, 3)]
    step_reads([3, 2, 0])  # context 1 goes from the middle of its slab (outside inference mode: a step's plan)
    assert slab_counts() == [(64, 1, 1), (160, 1, 2)]
    step_reads([2, 0, 1, 1, 4])  # context 1 back, read by two sequences; context 4 new
    assert slab_counts() == [(160, 1, 3), (160, 2, 1)]
    total = sum(slab.nbytes for slab in backend.head_major.slabs.values())
    assert backend.head_major.nbytes == total
    backend.release()
    assert not backend.head_major.copies and not backend.head_major.slabs and backend.head_major.nbytes == 0


def test_int8_cross_context_is_read_from_a_dequantized_head_major_copy():
    """An int8 pool's cross context is dequantized once into its head-major copy; reads from it give
    what the per-step int8 path (scales folded into scores and probabilities) gives."""
    from encdec_engine.quantization.kv_int8 import row_width

    length, num_kv_heads, head_dim = 150, 2, 64
    blocks = -(-length // BS)
    cache = torch.zeros(2, blocks + 1, BS, num_kv_heads, row_width(head_dim, torch.int8), dtype=torch.int8)
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(length, num_kv_heads, head_dim, generator=gen), torch.randn(length, num_kv_heads, head_dim,
                                                                                    generator=gen)
    store_kv(k, v, cache, torch.arange(BS, BS + length))
    q = torch.randn(1, H, head_dim, generator=gen)
    table = [list(range(1, 1 + blocks))]

    def decode(backend):
        view = make_view([1], [length], False, block_tables=torch.from_numpy(pad_rows(table)))
        backend.plan(AttentionMetadata(decoder=make_view([1], [1], True), cross=view))
        return backend.forward(q, None, None, cache, view, head_dim**-0.5)

    with_copy, folded = TorchSDPABackend(BS), TorchSDPABackend(BS)
    folded.head_major.budget = 0
    out = decode(with_copy)
    assert len(with_copy.head_major.copies) == 1 and not folded.head_major.copies
    torch.testing.assert_close(out, decode(folded), rtol=1e-5, atol=1e-5)


def test_decode_self_reads_come_from_rows_that_follow_every_change_of_their_sequences():
    """Several sequences decoding read their self contexts from rows the steps append to. Through
    growth past a block and past the rows' length, a sequence whose blocks change (copy-on-write: the
    same contents in other blocks), one that leaves, one that joins, and a block the cache engine
    rewrites, every sequence gets attention over exactly its own context."""
    num_kv_heads, num_blocks = 2, 128
    cache = torch.zeros(2, num_blocks, BS, num_kv_heads, D)
    gen = torch.Generator().manual_seed(4)
    free = list(range(num_blocks - 1, 0, -1))
    contexts: dict[int, tuple[list[int], list[torch.Tensor], list[torch.Tensor]]] = {}  # id -> (table, ks, vs)
    backend = TorchSDPABackend(BS)

    def grow(seq_id):  # the sequence's new position: a block when it needs one, K/V to store there
        table, ks, vs = contexts.setdefault(seq_id, ([], [], []))
        if len(ks) % BS == 0:
            table.append(free.pop())
        ks.append(torch.randn(num_kv_heads, D, generator=gen))
        vs.append(torch.randn(num_kv_heads, D, generator=gen))
        pos = len(ks) - 1
        return table[pos // BS] * BS + pos % BS

    def step(seq_ids):
        slots = [grow(s) for s in seq_ids]
        lens = [len(contexts[s][1]) for s in seq_ids]
        view = make_view([1] * len(seq_ids), lens, True, slot_mapping=torch.tensor(slots),
                         block_tables=torch.from_numpy(pad_rows([contexts[s][0] for s in seq_ids])))
        view.seq_ids = list(seq_ids)
        backend.plan(AttentionMetadata(decoder=view))
        q = torch.randn(len(seq_ids), H, D, generator=gen)
        key = torch.stack([contexts[s][1][-1] for s in seq_ids])
        value = torch.stack([contexts[s][2][-1] for s in seq_ids])
        with torch.inference_mode():
            out = backend.forward(q, key, value, cache, view, SCALE)
        for i, s in enumerate(seq_ids):
            k, v = torch.stack(contexts[s][1]), torch.stack(contexts[s][2])
            torch.testing.assert_close(out[i : i + 1], naive(q[i : i + 1], k, v, torch.zeros(1, len(k)), num_kv_heads),
                                       rtol=1e-5, atol=1e-5)
        return view

    for _ in range(3):  # the first steps copy the sequences in; the next ones append
        view = step([1, 2, 3])
    from encdec_engine.attention.backends.cpu_copies import SelfRowsPlan
    assert isinstance(view.plan, SelfRowsPlan) and view.plan.append is not None and not view.plan.rebuild
    table = contexts[2][0]  # copy-on-write: sequence 2's first block's contents move to a new block
    moved = free.pop()
    cache[:, moved] = cache[:, table[0]]
    table[0] = moved
    view = step([3, 2, 1])
    assert [row for _, row, _ in view.plan.rebuild] == [backend.self_rows.row_of[2]]
    for _ in range(2 * BS):  # past several blocks; sequence 1 leaves, 4 joins
        step([2, 3, 4])
    assert 1 not in backend.self_rows.row_of
    written = contexts[3][0][0]  # the cache engine rewrites a block of sequence 3 (a swap-in, say)
    cache[:, written] = torch.randn(cache[:, written].shape, generator=gen)
    for pos in range(BS):
        contexts[3][1][pos], contexts[3][2][pos] = cache[0, written, pos], cache[1, written, pos]
    backend.blocks_written([written])
    step([2, 3, 4])
    for _ in range(30):  # long contexts, then a new wave beside them: each run of rows read at its own length
        step([2, 3, 4])
    view = step([2, 3, 4, *range(5, 45)])
    assert [(first, after) for first, after, _ in view.plan.segments] == [(0, 3), (3, 43)]
    assert [length for _, _, length in view.plan.segments] == [len(contexts[2][1]), 1]
    backend.release()
    assert not backend.self_rows.row_of and not backend.self_rows.storage


def test_row_segments_split_where_rows_are_free_or_lengths_jump_and_merge_what_is_cheaper_together():
    from encdec_engine.attention.backends.cpu_copies import SEGMENT_GAP, row_segments
    assert row_segments([2, 0, 1], [40, 38, 41]) == [(0, 3, 41)]  # alike: one padded read
    assert row_segments(list(range(40)), [60] * 10 + [5] * 30) == [(0, 10, 60), (10, 40, 5)]
    far = 1 + SEGMENT_GAP + 20  # a row after many free ones
    assert row_segments([0, 1, far], [60, 60, 60]) == [(0, 2, 60), (far, far + 1, 60)]
    assert row_segments([0, 1, far], [7, 7, 7]) == [(0, far + 1, 7)]  # short: cheaper read together
    # a short run beside a long one costs less padded into it than read on its own
    assert row_segments([0, 1, 2], [60, 60, 5]) == [(0, 3, 60)]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not in this torch build")
@pytest.mark.parametrize("lens,num_kv_heads", [([600, 600], 3), ([520, 900, 40], 1)])
def test_long_bidirectional_prefill_through_onednn_matches_naive(lens, num_kv_heads, monkeypatch):
    """Whisper-like windows (equal lengths: the reshape path's case) and mixed lengths (a short one stays on
    SDPA), grouped-query heads, query blocks that do not divide the length: the oneDNN path equals attention
    computed in fp64, and every long sequence went through it."""
    from encdec_engine.attention.ops import onednn_attention

    out, reference, calls = long_prefill(monkeypatch, "attend", lens, 6, num_kv_heads, 16, seed=5,
                                         onednn_attention=torch.float32)
    assert sorted(calls) == sorted(n for n in lens if n >= onednn_attention.MIN_LENGTH)
    torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-5)


def long_prefill(monkeypatch, op: str, lens: list[int], heads: int, kv_heads: int, head_dim: int, seed: int,
                 **backend_options):
    """Fresh bidirectional attention over packed sequences of `lens` through a backend with `backend_options`,
    counting the sequences that went through onednn_attention's `op`: (output, the fp64 reference, the
    counted sequences' lengths)."""
    from encdec_engine.attention.ops import onednn_attention

    torch.manual_seed(seed)
    calls = []
    kernel = getattr(onednn_attention, op)
    monkeypatch.setattr(onednn_attention, op, lambda q, *a: (calls.append(q.shape[0]), kernel(q, *a)))
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).tolist()
    view = make_view(lens, lens, False, key_start_loc=starts)
    q = torch.randn(sum(lens), heads, head_dim)
    k, v = torch.randn(sum(lens), kv_heads, head_dim), torch.randn(sum(lens), kv_heads, head_dim)
    backend = TorchSDPABackend(BS)
    for name, value in backend_options.items():
        setattr(backend, name, value)
    out = backend.forward(q, k, v, None, view, head_dim**-0.5)
    reference = torch.cat([naive_attention(q[s : s + n], k[s : s + n], v[s : s + n], head_dim**-0.5)
                           for s, n in zip(starts, lens)])
    return out, reference, calls


@pytest.mark.skipif(not bf16_native(), reason="the engines multiply attention in bf16 only where oneDNN does natively")
def test_long_prefill_attention_in_bf16_stays_close():
    """The int8 engines' bf16 matmuls (fp32 sums and softmax): within bf16's rounding of the fp64 result."""
    from encdec_engine.attention.ops import onednn_attention

    torch.manual_seed(6)
    q, k, v = torch.randn(700, 4, 32), torch.randn(700, 2, 32), torch.randn(700, 2, 32)
    out = torch.empty_like(q)
    onednn_attention.attend(q, k, v, 32**-0.5, out, torch.bfloat16)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), naive_attention(q, k, v, 32**-0.5), rtol=0.0, atol=2e-2)


def test_long_prefill_attention_through_amx_flash_stays_close_and_is_taken_per_long_sequence(monkeypatch):
    """bf16 engines on AMX CPUs: torch's flash kernel in bf16 for each long sequence (the short one stays
    on SDPA in its own dtype), within bf16's rounding of the fp64 result; the output keeps the query's dtype."""
    out, reference, calls = long_prefill(monkeypatch, "amx_flash", [700, 40, 520], 4, 2, 32, seed=7,
                                         onednn_attention=torch.bfloat16, amx_flash=True)
    assert sorted(calls) == [520, 700] and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference, rtol=0.0, atol=2e-2)


def test_the_engine_gives_head_major_copies_room_for_every_cross_context_its_pool_holds(bart_path, make_llm):
    """Beyond the copies' budget a cross context is read from the pool on its own, two matmuls a layer: the
    budget is what the pool would take in fp32, so a full pool of cross contexts never gets there."""
    from encdec_engine.worker.cache_engine import bytes_per_block

    llm = make_llm(bart_path, kv_cache_space_gb=1.0)  # above the budget's 256 MB floor
    engine = llm.engine
    pool_fp32 = engine.kv_pool.num_blocks * bytes_per_block(engine.model.kv_cache_spec, engine.block_manager.block_size,
                                                            torch.float32)
    assert pool_fp32 > 2 * HEAD_MAJOR_BUDGET
    assert engine.runner.backend.head_major.budget >= pool_fp32
