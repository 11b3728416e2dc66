"""CPU (and fallback) backend on torch's scaled_dot_product_attention.

Never materializes an O(total_tokens^2) mask: fresh prefill attention runs
per sequence (sequences of equal shape are batched into one call), and
cache reads gather each sequence's context into a batch padded to the
longest context of this step, with a [num_seqs, max_key_len] padding mask.
A position bias (attention/position_bias.py) becomes an additive mask of the
same extent: [heads, q, k] per sequence shape, [num_seqs, heads, max_q, max_key]
per padded batch (made once per step and bias, shared by the layers), or
[heads, key_len] rows added to the scores of an in-place decode read.
Decode reads of a cross context read in place (fp32, or an int8 pool's rows
dequantized) go through a head-major copy of it (`HeadMajorContexts`), kept
while decode steps read it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from encdec_engine.attention.backends.base import store_kv
from encdec_engine.quantization.kv_int8 import as_stored, attend_int8_rows, num_groups, read_rows
from encdec_engine.attention.metadata import AttentionMetadata, AttentionView
from encdec_engine.attention.position_bias import PositionBias

_SLICE_MIN_KEYS = 128  # below this, one padded gather beats a loop over sequences (a lone one reads in place)
HEAD_MAJOR_BUDGET = 256 * 2**20  # bytes of head-major cross-context copies a backend may hold, at least


@dataclass
class GatherPlan:
    """Padded cache reads of one view, shared by every layer of a step."""

    slots: torch.Tensor  # [num_seqs * max_key_len] cache slot per padded key
    key_mask: torch.Tensor  # [num_seqs, 1, max_query_len, max_key_len] True = attend
    query_positions: torch.Tensor  # [num_seqs, max_query_len] position of each query among its sequence's keys
    bias_masks: dict = field(default_factory=dict)  # id(bias) -> (bias, additive mask): one per bias and step

    def additive_mask(self, bias: PositionBias, dtype: torch.dtype) -> torch.Tensor:
        """[num_seqs, heads, max_query_len, max_key_len]: the bias where key_mask attends, -inf elsewhere."""
        held = self.bias_masks.get(id(bias))
        if held is None:  # the bias is held with its mask: its id stays its own
            held = self.bias_masks[id(bias)] = (bias, bias.padded_mask(self.query_positions, self.key_mask, dtype))
        return held[1]


@dataclass
class FreshPlan:
    """Attention over this step's K/V: the position-bias masks of its sequence shapes, made once per step."""

    bias_blocks: dict = field(default_factory=dict)  # (id(bias), q_len, k_len) -> (bias, [1, H, q, k] mask)

    def bias_block(self, bias: PositionBias, q_len: int, k_len: int, causal: bool, query: torch.Tensor):
        key = (id(bias), q_len, k_len)
        held = self.bias_blocks.get(key)
        if held is None:  # the bias is held with its mask: its id stays its own
            mask = bias.additive_mask(q_len, k_len, causal, query.dtype, query.device)[None]  # [1, H, q, k]
            held = self.bias_blocks[key] = (bias, mask)
        return held[1]


@dataclass
class SlicePlan:
    """Decode reads where every sequence's context is one contiguous run of slots
    (the usual case for cross tables, allocated in one go): zero-copy views."""

    starts: list[int]  # first slot of each sequence's context
    readers: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # (first slot, length) -> sequences

    @classmethod
    def of(cls, starts: list[int], key_lens: list[int]) -> SlicePlan:
        """The plan with its readers grouped once, for every layer of the step: sequences that read the same
        context (the beams or best_of samples of one request share its cross cache) are one matmul."""
        readers: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i, context in enumerate(zip(starts, key_lens)):
            readers[context].append(i)
        return cls(starts, dict(readers))


def plan_gather(view: AttentionView, block_size: int) -> GatherPlan:
    assert view.block_tables is not None
    max_key = view.max_key_len
    device = view.block_tables.device
    pos = torch.arange(max_key, device=device)  # [max_key_len]
    blocks = view.block_tables.index_select(1, pos // block_size)  # [num_seqs, max_key_len]
    valid = pos[None, :] < view.key_lens[:, None]  # [num_seqs, max_key_len]
    slots = torch.where(valid, blocks * block_size + pos % block_size, 0)
    mask = valid[:, None, None, :]
    # Bottom-right aligned: query j of a sequence with q queries and k keys is at position k - q + j
    # (and, causal, sees keys up to it).
    q_lens = view.query_start_loc[1:] - view.query_start_loc[:-1]
    j = torch.arange(view.max_query_len, device=device)
    query_positions = view.key_lens[:, None] - q_lens[:, None] + j[None, :]  # [num_seqs, max_query_len]
    if view.causal and view.max_query_len > 1:
        mask = mask & (pos[None, None, :] <= query_positions[:, :, None])[:, None]
    return GatherPlan(slots.reshape(-1), mask, query_positions)


def plan_slices(view: AttentionView, block_size: int) -> SlicePlan | None:
    """A SlicePlan if every context is contiguous in the pool, else None."""
    if view.max_query_len != 1 or view.block_tables.device.type != "cpu":
        return None
    tables = view.block_tables.numpy()
    starts = []
    for i, key_len in enumerate(view.key_lens_list):
        used = tables[i, : -(-key_len // block_size)]
        if len(used) > 1 and not (used[1:] - used[:-1] == 1).all():
            return None
        starts.append(int(used[0]) * block_size)
    return SlicePlan.of(starts, view.key_lens_list)


@dataclass
class _Slab:
    """Head-major copies of contexts of one padded length (and reader count) in one layer's pool, one slot
    each, slots 0..count-1 in use: keys [cap, Hkv, D, Lc], values [cap, Hkv, Lc, D] (zero past a context's
    end), mask [cap, 1, 1, Lc] (0 on its keys, -inf past them)."""

    keys: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor
    contexts: list[tuple[int, int]] = field(default_factory=list)  # slot -> (start, length)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.mask))


@dataclass
class SlabRead:
    """One batched read: the readers' rows of this step ([count * n], slot-major) and the slab's slots."""

    rows: torch.Tensor
    readers: int  # n: sequences per context
    keys: torch.Tensor  # [count, Hkv, D, Lc]
    values: torch.Tensor  # [count, Hkv, Lc, D]
    mask: torch.Tensor  # [count, 1, 1, Lc]


class HeadMajorContexts:
    """Head-major fp32 copies of the cross contexts that decode steps read (fp32 or int8 pools; int8
    rows dequantized once here instead of at every step), batched by length: keys as [Hkv, D, L] and
    values as [Hkv, L, D], each head's rows contiguous. The paged layout [L, Hkv, D] makes every
    head's matmul stride over the other heads; at one query per step that read is memory bound,
    and on the AVX2 EPYC the copies cut a tiny.en step's four 1,500-position cross reads from about
    2.2 ms to 1.0 ms. Contexts whose lengths round up to the same multiple of `LENGTH_STEP` (read by
    the same number of sequences) share a slab, a padded batch read with one matmul per step instead of
    one per context: 256 Marian-base requests with 16..256 source tokens took 6.6 ms a layer in one
    loop over contexts, 4.7 ms in slabs of lengths rounded to 32 (memory bound; the batches run on
    every thread).
    A cross context is written once, at its request's prefill, so a copy made at its first decode
    read stays right while nothing writes its slots: every step drops the copies whose blocks it
    writes (self and cross stores) and, when it decodes, those it does not read; the cache engine
    reports its block moves and copy-on-write copies (`blocks_written`), and an idle engine drops
    them all (`release`). A dropped context's slot takes the slab's last one, so a slab's slots in
    use are always its first `count`. At most `budget` bytes are held; contexts beyond it are read
    from the pool."""

    LENGTH_STEP = 32

    def __init__(self, block_size: int, budget: int = HEAD_MAJOR_BUDGET) -> None:
        self.block_size, self.budget = block_size, budget
        self.slabs: dict[tuple[int, int, int], _Slab] = {}  # (pool, padded length, readers)
        self.copies: dict[tuple[int, int, int], tuple[tuple[int, int, int], int]] = {}  # (pool, start, len) -> slot
        self.nbytes = 0

    def reads(self, kv_cache: torch.Tensor, readers: dict[tuple[int, int], list[int]], head_dim: int,
              device: torch.device) -> tuple[list[SlabRead], dict[tuple[int, int], list[int]]]:
        """This layer's batched reads of the contexts in `readers` ((start, length) -> the rows that read
        it), copying the ones not held yet; and the contexts left to read from the pool (budget spent)."""
        pool = kv_cache.data_ptr()
        _, _, _, num_kv_heads, _ = kv_cache.shape
        rest: dict[tuple[int, int], list[int]] = {}
        new: dict[tuple[int, int, int], list[tuple[int, int]]] = defaultdict(list)  # slab -> contexts to copy
        for context, rows in readers.items():
            held = self.copies.get((pool, *context))
            if held is not None and held[0][2] != len(rows):  # read by a different number of sequences now
                self._drop((pool, *context))
                held = None
            if held is None:
                new[(pool, self.padded_length(context[1]), len(rows))].append(context)
        for slab_key, contexts in new.items():
            room = self._reserve(slab_key, len(contexts), num_kv_heads, head_dim)
            for context in contexts[:room]:
                self._copy(kv_cache, slab_key, context, head_dim)
            for context in contexts[room:]:
                rest[context] = readers[context]
        slot_rows: dict[tuple[int, int, int], list[list[int] | None]] = {}
        for context, rows in readers.items():
            held = self.copies.get((pool, *context))
            if held is not None:
                slab_key, slot = held
                slot_rows.setdefault(slab_key, [None] * len(self.slabs[slab_key].contexts))[slot] = rows
        out = []
        for slab_key, by_slot in slot_rows.items():
            slab = self.slabs[slab_key]
            if any(r is None for r in by_slot):  # a held context no reader asked for: read the others alone
                for slot, r in enumerate(by_slot):
                    if r is not None:
                        out.append(SlabRead(torch.tensor(r, device=device), len(r), slab.keys[slot : slot + 1],
                                            slab.values[slot : slot + 1], slab.mask[slot : slot + 1]))
                continue
            count = len(by_slot)
            rows = torch.tensor([i for r in by_slot for i in r], device=device)
            out.append(SlabRead(rows, slab_key[2], slab.keys[:count], slab.values[:count], slab.mask[:count]))
        return out, rest

    @classmethod
    def padded_length(cls, length: int) -> int:
        return -(-length // cls.LENGTH_STEP) * cls.LENGTH_STEP

    @classmethod
    def slot_nbytes(cls, length: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes of one slot for a context of `length` keys: its padded keys, values and mask, fp32."""
        return (2 * num_kv_heads * head_dim + 1) * cls.padded_length(length) * 4

    # Slabs are made and changed in inference mode, wherever the call comes from (a forward, or a
    # step's plan or the cache engine's block report outside one): their tensors are inference tensors.
    @torch.inference_mode()
    def _reserve(self, slab_key: tuple[int, int, int], count: int, num_kv_heads: int, head_dim: int) -> int:
        """Make room in a slab for `count` more contexts, as far as the budget allows: a full slab grows to
        what it needs, and by at least a quarter (requests arrive one by one). Returns the room made."""
        slab = self.slabs.get(slab_key)
        used, cap = (0, 0) if slab is None else (len(slab.contexts), slab.keys.shape[0])
        if used + count <= cap:
            return count
        padded = slab_key[1]
        per_slot = self.slot_nbytes(padded, num_kv_heads, head_dim)
        held = 0 if slab is None else slab.nbytes
        affordable = (self.budget - self.nbytes + held) // per_slot
        grown = min(max(used + count, -(-cap * 5 // 4)), affordable)
        if grown <= cap:
            return cap - used
        bigger = _Slab(torch.empty(grown, num_kv_heads, head_dim, padded),
                       torch.empty(grown, num_kv_heads, padded, head_dim), torch.empty(grown, 1, 1, padded),
                       [] if slab is None else slab.contexts)
        if slab is not None:
            bigger.keys[:used], bigger.values[:used], bigger.mask[:used] = slab.keys[:used], slab.values[:used], \
                slab.mask[:used]
        self.slabs[slab_key] = bigger
        self.nbytes += bigger.nbytes - held
        return min(count, grown - used)

    @torch.inference_mode()
    def _copy(self, kv_cache: torch.Tensor, slab_key: tuple[int, int, int], context: tuple[int, int],
              head_dim: int) -> None:
        """Copy a context from the pool into its slab's next slot (room reserved)."""
        start, length = context
        _, _, _, num_kv_heads, width = kv_cache.shape
        slab = self.slabs[slab_key]
        slot = len(slab.contexts)
        k = read_rows(kv_cache[0].view(-1, num_kv_heads, width)[start : start + length], head_dim, torch.float32)
        v = read_rows(kv_cache[1].view(-1, num_kv_heads, width)[start : start + length], head_dim, torch.float32)
        slab.keys[slot, :, :, :length] = k.permute(1, 2, 0)
        slab.values[slot, :, :length] = v.transpose(0, 1)
        slab.keys[slot, :, :, length:] = 0  # zeros, not garbage: 0 * NaN would be NaN
        slab.values[slot, :, length:] = 0
        slab.mask[slot, ..., :length] = 0.0
        slab.mask[slot, ..., length:] = float("-inf")
        slab.contexts.append(context)
        self.copies[(slab_key[0], start, length)] = (slab_key, slot)

    def keep(self, contexts: set[tuple[int, int]]) -> None:
        """Drop the copies of every context but these (start, length) pairs."""
        if not contexts:
            self.copies.clear()
            self.slabs.clear()
            self.nbytes = 0
            return
        for key in [k for k in self.copies if k[1:] not in contexts]:
            self._drop(key)

    def blocks_written(self, blocks) -> None:
        """Drop the copies of contexts that overlap these blocks."""
        if not self.copies or len(blocks) == 0:
            return
        blocks = np.asarray(blocks, dtype=np.int64)
        for key in list(self.copies):
            _, start, length = key
            first, end = start // self.block_size, -(-(start + length) // self.block_size)
            if ((blocks >= first) & (blocks < end)).any():
                self._drop(key)

    def slots_written(self, slots: torch.Tensor | None) -> None:
        if self.copies and slots is not None and slots.numel():
            self.blocks_written(np.unique(slots.cpu().numpy() // self.block_size))

    @torch.inference_mode()
    def _drop(self, key) -> None:
        """Drop one context's copy: the slab's last slot moves into its place (the slab goes when empty)."""
        slab_key, slot = self.copies.pop(key)
        slab = self.slabs[slab_key]
        last = len(slab.contexts) - 1
        if slot != last:
            slab.keys[slot], slab.values[slot], slab.mask[slot] = slab.keys[last], slab.values[last], slab.mask[last]
            moved = slab.contexts[slot] = slab.contexts[last]
            self.copies[(slab_key[0], *moved)] = (slab_key, slot)
        slab.contexts.pop()
        if not slab.contexts:
            self.nbytes -= slab.nbytes
            del self.slabs[slab_key]


@dataclass
class SelfRowsPlan:
    """A decode step's self reads from `SelfRows`: what each layer appends or rebuilds, then reads."""

    rows: torch.Tensor  # [num_seqs] each sequence's row
    high: int  # rows 0..high-1 are read (free rows among them are computed and ignored)
    length: int  # positions read: the longest context of the step
    key_mask: torch.Tensor  # [high, 1, 1, length] True = attend
    query_positions: torch.Tensor  # [high, 1] each row's query position
    append: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (sequences, rows, positions) to append
    rebuild: list[tuple[int, int, int]]  # (sequence, row, length): copied whole from the pool
    masks: dict = field(default_factory=dict)  # id(bias) or None -> (bias, additive mask), once per step

    def additive_mask(self, bias: PositionBias | None, dtype: torch.dtype) -> torch.Tensor:
        held = self.masks.get(id(bias) if bias is not None else None)
        if held is None:
            if bias is None:
                mask = torch.zeros(self.key_mask.shape, dtype=dtype).masked_fill_(~self.key_mask, float("-inf"))
            else:
                mask = bias.padded_mask(self.query_positions, self.key_mask, dtype)
            held = self.masks[id(bias) if bias is not None else None] = (bias, mask)
        return held[1]


class SelfRows:
    """Head-major fp32 copies of the decoding sequences' self contexts, one row per sequence, grown by
    the step's own new K/V: keys [rows, Hkv, D, positions], values [rows, Hkv, positions, D] per layer.
    A decode step of many sequences would otherwise gather every sequence's whole context from its
    blocks at every layer (a padded copy) and attend to that copy; here it writes one position per
    sequence and reads all of them with one matmul. T5-base, 128 sequences at 64 positions: the
    gather and SDPA took about 4 ms a layer.
    A row is kept while its sequence decodes and its blocks stay its blocks: a step checks that the
    blocks holding what the row has are still the sequence's (copy-on-write, a beam that takes
    another's table: copied again from the pool) and that the row has every position but the new
    one; a sequence not in a decode step loses its row, and an idle engine drops them all."""

    LENGTH_STEP = 64

    def __init__(self, block_size: int, budget: int = HEAD_MAJOR_BUDGET) -> None:
        self.block_size, self.budget = block_size, budget
        self.position_bytes = 0  # bytes of one position of one row over every layer (known after a step)
        self.clear()

    def clear(self) -> None:
        """Drop every row (the bytes a position takes, learned at the first step, stay known)."""
        self.row_of: dict[int, int] = {}  # sequence id -> row
        self.have: list[int] = []  # positions each row holds
        self.tables: list[np.ndarray] = []  # the blocks holding them
        self.free: list[int] = []
        self.length_cap = 0
        self.storage: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # pool -> (keys, values)

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.storage.values())

    def plan(self, view: AttentionView) -> SelfRowsPlan | None:
        """The step's plan, or None (state dropped) when its rows would not fit the budget."""
        bs, seq_ids, key_lens = self.block_size, view.seq_ids, view.key_lens_list
        for seq_id in set(self.row_of) - set(seq_ids):  # not decoding this step: its row goes
            self.free.append(self.row_of.pop(seq_id))
        tables = view.block_tables.numpy()
        rows, rebuild, append = [], [], ([], [], [])
        for i, (seq_id, m) in enumerate(zip(seq_ids, key_lens)):
            row = self.row_of.get(seq_id)
            held = -(-(m - 1) // bs)
            if (row is not None and self.have[row] == m - 1
                    and np.array_equal(self.tables[row][:held], tables[i, :held])):
                for column, value in zip(append, (i, row, m - 1)):
                    column.append(value)
            else:
                if row is None:
                    row = self.free.pop() if self.free else len(self.have)
                    if row == len(self.have):
                        self.have.append(0)
                        self.tables.append(tables[i, :0])
                    self.row_of[seq_id] = row
                rebuild.append((i, row, m))
            self.have[row], self.tables[row] = m, tables[i, : -(-m // bs)].copy()
            rows.append(row)
        length = max(key_lens)
        if length > self.length_cap:
            self.length_cap = -(-(length + 1) // self.LENGTH_STEP) * self.LENGTH_STEP
        high = len(self.have)
        if self.position_bytes * high * self.length_cap > self.budget:
            self.clear()
            return None
        have = torch.tensor(self.have)
        key_mask = (torch.arange(length)[None, :] < have[:, None])[:, None, None, :]
        as_tensors = tuple(torch.tensor(c) for c in append) if append[0] else None
        return SelfRowsPlan(torch.tensor(rows), high, length, key_mask, (have - 1).clamp_(min=0)[:, None],
                            as_tensors, rebuild)

    @torch.inference_mode()
    def layer(self, kv_cache: torch.Tensor, head_dim: int, plan: SelfRowsPlan, view: AttentionView,
              key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's rows, brought up to the step: (keys, values) of rows 0..high-1 and positions
        0..length-1."""
        _, _, _, num_kv_heads, width = kv_cache.shape
        pool = kv_cache.data_ptr()
        rows_cap = max(plan.high, 1)
        keys, values = self.storage.get(pool, (None, None))
        if keys is None or keys.shape[0] < rows_cap or keys.shape[-1] < self.length_cap:
            grown_rows = rows_cap if keys is None else max(rows_cap, -(-keys.shape[0] * 5 // 4))
            new_k = torch.zeros(grown_rows, num_kv_heads, head_dim, self.length_cap)  # zeros: 0 * NaN is NaN
            new_v = torch.zeros(grown_rows, num_kv_heads, self.length_cap, head_dim)
            if keys is not None:
                r, n = keys.shape[0], keys.shape[-1]
                new_k[:r, :, :, :n], new_v[:r, :, :n] = keys, values
            keys, values = self.storage[pool] = new_k, new_v
            self.position_bytes = sum(k.shape[1] * k.shape[2] * 2 * 4 for k, _ in self.storage.values())
        if plan.append is not None:
            seqs, rows, positions = plan.append
            keys[rows, :, :, positions] = as_stored(key[seqs], kv_cache.dtype).float()  # int8: rounded as stored
            values[rows, :, positions] = as_stored(value[seqs], kv_cache.dtype).float()
        bs = self.block_size
        pool_keys, pool_values = kv_cache[0].view(-1, num_kv_heads, width), kv_cache[1].view(-1, num_kv_heads, width)
        for i, row, m in plan.rebuild:
            pos = torch.arange(m)
            slots = view.block_tables[i, pos // bs] * bs + pos % bs
            keys[row, :, :, :m] = read_rows(pool_keys.index_select(0, slots), head_dim, torch.float32).permute(1, 2, 0)
            values[row, :, :m] = read_rows(pool_values.index_select(0, slots), head_dim, torch.float32).transpose(0, 1)
        return keys[: plan.high, :, :, : plan.length], values[: plan.high, :, : plan.length]


class TorchSDPABackend:
    name = "torch-sdpa"
    supports_cuda_graphs = False  # decode slices and gathers by host-side key lengths

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.head_major = HeadMajorContexts(block_size)
        self.self_rows = SelfRows(block_size)

    def blocks_written(self, blocks: list[int]) -> None:
        """The cache engine moved or copied K/V into these blocks."""
        self.head_major.blocks_written(blocks)
        if len(blocks):  # a row holding one of them is copied again from the pool at its next read
            written = np.asarray(blocks, dtype=np.int64)
            for row, table in enumerate(self.self_rows.tables):
                if np.isin(table, written).any():
                    self.self_rows.have[row] = -1

    def size_copies(self, pool_fp32_bytes: int) -> None:
        """Let the head-major copies take up to half of what the KV pool would take in fp32 (at least
        HEAD_MAJOR_BUDGET): room for every cross context that half the pool's decode steps read at once."""
        self.head_major.budget = self.self_rows.budget = max(HEAD_MAJOR_BUDGET, pool_fp32_bytes // 2)

    def release(self) -> None:
        """The engine is idle: drop the head-major copies and the self rows."""
        self.head_major.keep(set())
        self.self_rows.clear()

    def plan(self, metadata: AttentionMetadata) -> None:
        for view in (metadata.encoder, metadata.decoder, metadata.cross):
            if view is not None and not view.reads_cache:
                view.plan = FreshPlan()
        for view in (metadata.decoder, metadata.cross):
            if view is not None:
                self.head_major.slots_written(view.slot_mapping)
            if view is not None and view.reads_cache:
                if (view.seq_ids is not None and view.causal and view.max_query_len == 1 and view.num_seqs > 1
                        and view.block_tables.device.type == "cpu"):
                    view.plan = self.self_rows.plan(view)  # several sequences decoding: their self rows
                    if view.plan is not None:
                        continue
                # Long contexts (or a lone sequence's) read in place when contiguous; short ones gather
                # into one batch.
                in_place = view.max_key_len >= _SLICE_MIN_KEYS or view.num_seqs == 1
                slices = plan_slices(view, self.block_size) if in_place else None
                view.plan = slices or plan_gather(view, self.block_size)
        decode_reads = [v for v in (metadata.decoder, metadata.cross)
                         if v is not None and v.reads_cache and not v.causal and v.max_query_len == 1]
        if decode_reads:  # a decode step: the copies of contexts it does not read go
            self.head_major.keep({context for v in decode_reads if isinstance(v.plan, SlicePlan)
                                  for context in zip(v.plan.starts, v.key_lens_list)})

    def forward(self, query, key, value, kv_cache, view: AttentionView, scale: float,
                position_bias: PositionBias | None = None) -> torch.Tensor:
        if key is not None and view.slot_mapping is not None and kv_cache is not None:
            store_kv(key, value, kv_cache, view.slot_mapping)
            if not view.reads_cache:  # attend to the K/V as the cache holds them (int8: rounded)
                key, value = as_stored(key, kv_cache.dtype), as_stored(value, kv_cache.dtype)
        if isinstance(view.plan, SelfRowsPlan) and query.dtype == torch.float32 and kv_cache.dtype in (torch.float32,
                                                                                                    torch.int8):
            return self._attend_self_rows(query, key, value, kv_cache, view, scale, position_bias)
        if view.reads_cache:
            return self._attend_cache(query, kv_cache, view, scale, position_bias)
        return self._attend_fresh(query, key, value, view, scale, position_bias)

    def _attend_self_rows(self, query, key, value, kv_cache, view: AttentionView, scale: float,
                          position_bias: PositionBias | None) -> torch.Tensor:
        """Decode self-attention over the sequences' rows (`SelfRows`): one padded matmul for all."""
        plan: SelfRowsPlan = view.plan
        head_dim, num_heads = query.shape[-1], query.shape[1]
        keys, values = self.self_rows.layer(kv_cache, head_dim, plan, view, key, value)
        num_kv_heads = keys.shape[1]
        group = num_heads // num_kv_heads
        q = torch.zeros(plan.high, num_heads, head_dim)
        q.index_copy_(0, plan.rows, query if scale == 1.0 else query * scale)
        scores = torch.matmul(q.view(plan.high, num_kv_heads, group, head_dim), keys)  # [high, Hkv, G, L]
        mask = plan.additive_mask(position_bias, scores.dtype)  # [high, 1 or H, 1, L]
        scores += mask.view(plan.high, -1, group if mask.shape[1] > 1 else 1, plan.length)
        o = torch.matmul(torch.softmax(scores, dim=-1), values)  # [high, Hkv, G, D]
        return o.view(plan.high, num_heads, head_dim).index_select(0, plan.rows)

    def _attend_fresh(self, query, key, value, view: AttentionView, scale: float,
                      position_bias: PositionBias | None = None) -> torch.Tensor:
        """Block-diagonal attention over this step's K/V, one SDPA call per sequence shape (with a
        position bias, one [heads, q, k] mask per shape: its sequences share their relative positions)."""
        q_loc, k_loc, k_lens = view.query_start_loc_list, view.key_start_loc_list, view.key_lens_list
        out = torch.empty_like(query)
        by_shape: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i in range(len(k_lens)):
            by_shape[(q_loc[i + 1] - q_loc[i], k_lens[i])].append(i)
        gqa = query.shape[1] != key.shape[1]
        for (q_len, k_len), seqs in by_shape.items():
            if q_len == 0:
                continue
            mask = None
            if position_bias is not None:
                fresh = view.plan if isinstance(view.plan, FreshPlan) else FreshPlan()
                mask = fresh.bias_block(position_bias, q_len, k_len, view.causal, query)
            causal = view.causal and mask is None
            if len(seqs) == 1:
                i = seqs[0]
                q = query[q_loc[i] : q_loc[i + 1]].transpose(0, 1)[None]  # [1, H, q, D]
                k = key[k_loc[i] : k_loc[i] + k_len].transpose(0, 1)[None]  # [1, Hkv, k, D]
                v = value[k_loc[i] : k_loc[i] + k_len].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                                   enable_gqa=gqa)
                out[q_loc[i] : q_loc[i + 1]] = o[0].transpose(0, 1)
                continue
            n = len(seqs)
            if (len(by_shape) == 1 and query.shape[0] == n * q_len and key.shape[0] == n * k_len
                    and _uniform(q_loc, q_len) and _uniform(k_loc, k_len)):
                # Back-to-back equal segments (e.g. Whisper windows): plain reshapes, no gathers.
                q = query.view(n, q_len, *query.shape[1:]).transpose(1, 2)  # [n, H, q, D]
                k = key.view(n, k_len, *key.shape[1:]).transpose(1, 2)
                v = value.view(n, k_len, *value.shape[1:]).transpose(1, 2)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                                   enable_gqa=gqa)
                return o.transpose(1, 2).reshape(query.shape)
            q_idx = _segments(q_loc, seqs, q_len, query.device)  # [n, q]
            k_idx = _segments(k_loc, seqs, k_len, query.device)  # [n, k]
            q = query[q_idx].transpose(1, 2)  # [n, H, q, D]
            k = key[k_idx].transpose(1, 2)
            v = value[k_idx].transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
            out[q_idx.reshape(-1)] = o.transpose(1, 2).reshape(-1, *query.shape[1:])
        return out

    def _attend_cache(self, query, kv_cache, view: AttentionView, scale: float,
                      position_bias: PositionBias | None = None) -> torch.Tensor:
        """Paged attention: read each sequence's cached context in place or gathered, padded per batch."""
        if isinstance(view.plan, SlicePlan):
            return self._attend_slices(query, kv_cache, view, view.plan, scale, position_bias)
        plan = view.plan if isinstance(view.plan, GatherPlan) else plan_gather(view, self.block_size)
        key_mask = plan.key_mask if position_bias is None else plan.additive_mask(position_bias, query.dtype)
        _, _, _, num_kv_heads, width = kv_cache.shape
        num_seqs, max_key, head_dim = view.num_seqs, view.max_key_len, query.shape[-1]
        k = read_rows(kv_cache[0].view(-1, num_kv_heads, width).index_select(0, plan.slots), head_dim, query.dtype)
        v = read_rows(kv_cache[1].view(-1, num_kv_heads, width).index_select(0, plan.slots), head_dim, query.dtype)
        k = k.view(num_seqs, max_key, num_kv_heads, head_dim).transpose(1, 2)  # [n, Hkv, L, D]
        v = v.view(num_seqs, max_key, num_kv_heads, head_dim).transpose(1, 2)
        gqa = query.shape[1] != num_kv_heads
        if view.max_query_len == 1:
            q = query[:, :, None, :].to(k.dtype)  # [n, H, 1, D]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask.to(k.dtype) if key_mask.is_floating_point()
                                               else key_mask, scale=scale, enable_gqa=gqa)
            return o[:, :, 0, :].to(query.dtype)
        out = torch.empty_like(query)
        q_loc = view.query_start_loc_list
        for i in range(num_seqs):
            q_len = q_loc[i + 1] - q_loc[i]
            if q_len == 0:
                continue
            q = query[q_loc[i] : q_loc[i + 1]].transpose(0, 1)[None].to(k.dtype)  # [1, H, q, D]
            mask = key_mask[i : i + 1, :, :q_len]
            mask = mask.to(k.dtype) if mask.is_floating_point() else mask
            o = F.scaled_dot_product_attention(q, k[i : i + 1], v[i : i + 1], attn_mask=mask, scale=scale,
                                               enable_gqa=gqa)
            out[q_loc[i] : q_loc[i + 1]] = o[0].transpose(0, 1).to(query.dtype)
        return out


    def _attend_slices(self, query, kv_cache, view: AttentionView, plan: SlicePlan, scale: float,
                       position_bias: PositionBias | None = None) -> torch.Tensor:
        """One query per sequence against its contiguous run of slots. In fp32, two batched matmuls over
        the kv heads: SDPA would copy the strided [L, H, D] -> [H, L, D] views first (4x slower for a
        1,500-key cross read). Sequences that read the same context (the beams or best_of samples of
        one request share its cross cache) are one matmul over their stacked queries, so the context
        is read once, not once per sequence. Half precision keeps SDPA, which accumulates the softmax
        in fp32. An int8 cache with one scale per row is read with its scales applied to the scores
        and probabilities (`attend_int8_rows`); other int8 rows are dequantized one context at a time.
        A cross context (fp32 or int8 pool, fp32 queries) is read from its head-major copy while the
        budget allows, in one padded batch with the others of its slab (`HeadMajorContexts`). A position
        bias is added to each context's scores ([heads, key_len]: its readers' one query each sits at its
        last key)."""
        _, _, _, num_kv_heads, width = kv_cache.shape
        head_dim = query.shape[-1]
        keys = kv_cache[0].view(-1, num_kv_heads, width)
        values = kv_cache[1].view(-1, num_kv_heads, width)
        group = query.shape[1] // num_kv_heads  # query heads per kv head
        out = torch.empty_like(query)
        fold_scales = (kv_cache.dtype == torch.int8 and query.dtype == torch.float32 and num_groups(head_dim) == 1
                       and position_bias is None)
        head_major = (not view.causal and query.dtype == torch.float32 and position_bias is None
                      and kv_cache.dtype in (torch.float32, torch.int8))
        scaled = query if scale == 1.0 else query * scale  # the matmul paths' queries (1.0: the model scaled them)
        readers = plan.readers
        if head_major:
            slab_reads, readers = self.head_major.reads(kv_cache, readers, head_dim, query.device)
            for read in slab_reads:
                self._read_slab(scaled, read, out, num_kv_heads, group, head_dim)
        for (start, key_len), rows in readers.items():
            bias = None if position_bias is None else position_bias.block(1, key_len, query.device)  # [H, 1, L]
            if fold_scales:
                for i in rows:
                    out[i] = attend_int8_rows(query[i], keys[start : start + key_len],
                                              values[start : start + key_len], scale)
                continue
            k = read_rows(keys[start : start + key_len], head_dim, query.dtype)  # [L, Hkv, D]
            v = read_rows(values[start : start + key_len], head_dim, query.dtype)
            if k.dtype != torch.float32:
                k, v = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, L, D]
                mask = None if bias is None else bias.to(k.dtype)
                for i in rows:
                    q = query[i, :, None, :].to(k.dtype)  # [H, 1, D]
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=group > 1)
                    out[i] = o[:, 0].to(query.dtype)
                continue
            keys_t, v = k.permute(1, 2, 0), v.transpose(0, 1)  # [Hkv, D, L], [Hkv, L, D]
            n = len(rows)
            if n == 1:  # [Hkv, G, D]: the kv heads' queries, a view
                q = scaled[rows[0]].view(num_kv_heads, group, head_dim)
            else:  # [Hkv, n * G, D]: each kv head's queries from every reader, reader-major
                q = scaled[rows].view(n, num_kv_heads, group, head_dim).transpose(0, 1)
                q = q.reshape(num_kv_heads, n * group, head_dim)
            scores = torch.bmm(q, keys_t)  # [Hkv, n * G, L]
            if bias is not None:  # per query head: [Hkv, G, L], the same for each reader
                bias = bias.view(num_kv_heads, 1, group, key_len).expand(num_kv_heads, n, group, key_len)
                scores += bias.reshape(num_kv_heads, n * group, key_len)
            probs = torch.softmax(scores, dim=-1)  # [Hkv, n*G, L]
            if n == 1:  # straight into the output row
                torch.bmm(probs, v, out=out[rows[0]].view(num_kv_heads, group, head_dim))
                continue
            o = torch.bmm(probs, v)  # [Hkv, n * G, D]
            out[rows] = o.view(num_kv_heads, n, group, head_dim).transpose(0, 1).reshape(n, -1, head_dim)
        return out

    @staticmethod
    def _read_slab(scaled, read: SlabRead, out, num_kv_heads: int, group: int, head_dim: int) -> None:
        """Attend the readers of a slab's contexts, into their rows of `out`."""
        count, n = read.keys.shape[0], read.readers
        # [count, Hkv, n * G, D]: each context's readers' queries, head by head
        q = scaled.index_select(0, read.rows).view(count, n, num_kv_heads, group, head_dim)
        q = q.transpose(1, 2).reshape(count, num_kv_heads, n * group, head_dim)
        scores = torch.matmul(q, read.keys)  # [count, Hkv, n * G, Lc]
        scores += read.mask
        probs = torch.softmax(scores, dim=-1)
        o = torch.matmul(probs, read.values)  # [count, Hkv, n * G, D]
        o = o.view(count, num_kv_heads, n, group, head_dim).transpose(1, 2).reshape(count * n, -1, head_dim)
        out.index_copy_(0, read.rows, o)


def _uniform(starts: list[int], length: int) -> bool:
    """Segments i start at i * length: the flat batch is exactly [n, length]."""
    return all(start == i * length for i, start in enumerate(starts))


def _segments(starts: list[int], seqs: list[int], length: int, device: torch.device) -> torch.Tensor:
    """Token indices [len(seqs), length] of equal-length segments of a flat batch."""
    base = torch.tensor([starts[i] for i in seqs], device=device)
    return base[:, None] + torch.arange(length, device=device)[None, :]
