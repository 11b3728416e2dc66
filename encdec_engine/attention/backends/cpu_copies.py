"""Head-major fp32 copies that the CPU backend reads decode attention from (`torch_sdpa.py`).

The paged layout `[block, position, head, dim]` makes every head's matmul stride over the other heads,
and a decode step of many sequences would read each context on its own or gather them into a padded
batch at every layer. Two kinds of copies instead, each read with one matmul a layer:

    HeadMajorContexts   cross contexts (written once, at prefill), batched in slabs by padded length
    SelfRows            the decoding sequences' self contexts, one row each, grown by each step's K/V

Both hold at most `budget` bytes (the engine sets what the KV pool would take in fp32) and
are dropped when their blocks are written by others, when their sequences stop decoding, and when
the engine goes idle.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from encdec_engine.attention.metadata import AttentionView
from encdec_engine.attention.position_bias import PositionBias
from encdec_engine.quantization.kv_int8 import as_stored, read_rows

HEAD_MAJOR_BUDGET = 256 * 2**20  # bytes of copies a backend may hold, at least


@dataclass
class _Slab:
    """Head-major copies of contexts of one padded length (and reader count) in one layer's pool, one slot
    each, slots 0..count-1 in use: keys [cap, Hkv, Lc, D], values [cap, Hkv, D, Lc] (zero past a context's
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
    keys: torch.Tensor  # [count, Hkv, Lc, D]
    values: torch.Tensor  # [count, Hkv, D, Lc]
    mask: torch.Tensor  # [count, 1, 1, Lc]


class HeadMajorContexts:
    """Head-major fp32 copies of the cross contexts that decode steps read (fp32 or int8 pools; int8
    rows dequantized once here instead of at every step), batched by length: keys as [Hkv, L, D] and
    values as [Hkv, D, L], each head's rows contiguous. A step's few queries are then the narrow side of
    both products (keys @ q, values @ p), which read the copies at 44 GB/s against 34 GB/s for
    q @ [D, L] keys and p @ [L, D] values (8 small-shape contexts: 2.15 -> 1.68 ms a layer). The paged
    layout [L, Hkv, D] makes every head's matmul stride over the other heads; at one query per step
    that read is memory bound, and on the AVX2 EPYC the copies cut a tiny.en step's four
    1,500-position cross reads from about 2.2 ms to 1.0 ms. Contexts whose lengths round up to the
    same multiple of `LENGTH_STEP` (read by the same number of sequences) share a slab, a padded batch
    read with one matmul per step instead of one per context: 256 Marian-base requests with 16..256 source tokens took 6.6 ms a layer in one
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
        bigger = _Slab(torch.empty(grown, num_kv_heads, padded, head_dim),
                       torch.empty(grown, num_kv_heads, head_dim, padded), torch.empty(grown, 1, 1, padded),
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
        slab.keys[slot, :, :length] = k.transpose(0, 1)
        slab.values[slot, :, :, :length] = v.permute(1, 2, 0)
        slab.keys[slot, :, length:] = 0  # zeros, not garbage: 0 * NaN would be NaN
        slab.values[slot, :, :, length:] = 0
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
    segments: list[tuple[int, int, int]]  # (first row, row after, positions): each read with its own matmuls
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


SEGMENT_COST = 256  # a segment's fixed cost (its own matmuls, softmax, mask), in rows x positions read
SEGMENT_GAP = 8  # free rows that end a segment
SEGMENT_SPREAD = 32  # positions a segment's rows may differ by from its first row's


def row_segments(rows: list[int], lengths: list[int]) -> list[tuple[int, int, int]]:
    """The rows read as contiguous runs, each at its own longest context: (first row, row after,
    positions). One padded read of every row costs the longest context for all; a step where a new
    wave of requests (a dozen positions) decodes beside the tail of an old one (sixty) would read
    each new row at sixty. Runs start where rows are free for `SEGMENT_GAP` or the context length
    jumps by more than `SEGMENT_SPREAD`; neighbours whose padded read together costs no more than
    apart (with `SEGMENT_COST` a run) are merged again."""
    order = sorted(zip(rows, lengths))
    runs: list[list[int]] = []  # [first, after, longest, first row's length]
    for row, m in order:
        last = runs[-1] if runs else None
        if last is None or row - (last[1] - 1) > SEGMENT_GAP or abs(m - last[3]) > SEGMENT_SPREAD:
            runs.append([row, row + 1, m, m])
        else:
            last[1], last[2] = row + 1, max(last[2], m)
    merged = [runs[0]]
    for run in runs[1:]:
        prev = merged[-1]
        apart = (prev[1] - prev[0]) * prev[2] + (run[1] - run[0]) * run[2] + SEGMENT_COST
        if (run[1] - prev[0]) * max(prev[2], run[2]) <= apart:
            prev[1], prev[2] = run[1], max(prev[2], run[2])
        else:
            merged.append(run)
    return [(first, after, longest) for first, after, longest, _ in merged]


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

    def blocks_written(self, blocks) -> None:
        """The cache engine wrote these blocks: a row holding one of them is copied again from the pool at
        its next read."""
        if len(blocks) == 0:
            return
        written = np.asarray(blocks, dtype=np.int64)
        for row, table in enumerate(self.tables):
            if np.isin(table, written).any():
                self.have[row] = -1

    def plan(self, view: AttentionView) -> SelfRowsPlan | None:
        """The step's plan, or None (state dropped) when its rows would not fit the budget."""
        bs, seq_ids, key_lens = self.block_size, view.seq_ids, view.key_lens_list
        for seq_id in set(self.row_of) - set(seq_ids):  # not decoding this step: its row goes
            heapq.heappush(self.free, self.row_of.pop(seq_id))
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
                    # the lowest free row: sequences admitted together sit together (`row_segments`)
                    row = heapq.heappop(self.free) if self.free else len(self.have)
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
        if self.position_bytes * len(self.have) * self.length_cap > self.budget:
            self.clear()
            return None
        high = max(rows) + 1
        have = torch.tensor(self.have[:high])
        key_mask = (torch.arange(length)[None, :] < have[:, None])[:, None, None, :]
        as_tensors = tuple(torch.tensor(c) for c in append) if append[0] else None
        return SelfRowsPlan(torch.tensor(rows), high, length, row_segments(rows, key_lens), key_mask,
                            (have - 1).clamp_(min=0)[:, None], as_tensors, rebuild)

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
