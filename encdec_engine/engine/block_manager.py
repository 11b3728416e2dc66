"""Paged KV block accounting: self tables per decoder sequence, cross tables per request.

One pool of fixed-size blocks backs both attention types. A group owns

    |cross table| + sum_i |self table of seq i|

blocks (forked sequences share full blocks through reference counts, so a
shared block counts once). Block 0 of the device pool is never handed out: the
model runner pads block tables and slot mappings with it.

Torch-free on purpose: tables are plain `list[int]` and every operation is
checked by millisecond unit tests.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
from collections import OrderedDict

import numpy as np

from encdec_engine.sequence import SequenceStatus
from encdec_engine.engine.sequence_group import Sequence, SequenceGroup


class AllocStatus(enum.Enum):
    OK = enum.auto()  # fits now
    LATER = enum.auto()  # fits once other requests free blocks
    NEVER = enum.auto()  # larger than the whole pool


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def chain_hash(previous: bytes, *parts) -> bytes:
    """Content key of a block: a digest of its parent's key and its own content,
    so equal keys mean an equal prefix (no collisions to worry about)."""
    h = hashlib.sha256(previous)
    for part in parts:
        h.update(repr(part).encode())
    return h.digest()


class BlockAllocator:
    """Free blocks and reference counts of one pool, with an optional content cache.

    A freed block that holds cached content (it has a hash) stays findable
    until it is handed out again. Free blocks are handed out in this order:
    those without cached content, most recently freed first (their memory is
    mapped and warm: a block never written costs a page fault per 4 KiB at
    its first write, and taking fresh blocks while freed ones wait would
    touch the whole pool, growing the process by its size); then blocks
    never used; then cached blocks, least recently freed first, so cached
    content lives as long as possible.

    A hash registered while a step is being scheduled is pending: the step's
    own groups may share it (they run in the same forward), and it stays once
    the step succeeded (`commit`); a failed step never wrote the block, so
    `rollback` un-registers it and no later request reads garbage.
    """

    def __init__(self, num_blocks: int, first_id: int = 0) -> None:
        self.num_blocks = num_blocks
        self.first_id = first_id
        self.reset()

    def reset(self) -> None:
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.first_id, self.first_id + self.num_blocks))
        self._refs: dict[int, int] = {}
        self._cached: dict[bytes, int] = {}  # content key -> block
        self._hash_of: dict[int, bytes] = {}  # block -> content key
        self._pending: list[tuple[bytes, int]] = []  # registered since the last commit or rollback

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, after: int | None = None) -> int:
        """The first free block in the order above; but `after + 1` when that one is free and holds no cached
        content, so that a table grown block by block stays one run of ids (the CPU attention reads
        a lone sequence's run in place instead of gathering it at every step)."""
        if not self._free:
            raise RuntimeError("out of KV cache blocks")
        if after is not None and after + 1 in self._free and after + 1 not in self._hash_of:
            return self._take(after + 1)
        return self._take(next(iter(self._free)))

    def allocate_run(self, n: int) -> list[int]:
        """n blocks with consecutive ids where the free list has such a run, so that a context allocated
        at once (a cross table) is read in place rather than gathered at every decode step. The first n
        free blocks (in the order above) when they are one run without cached content, in ascending
        order; else the run holding the fewest cached blocks (the lowest such); else, the pool too
        fragmented, the first n."""
        if n > len(self._free):
            raise RuntimeError("out of KV cache blocks")
        first = list(itertools.islice(self._free, n))
        if first and max(first) - min(first) == n - 1 and not any(b in self._hash_of for b in first):  # one run
            return [self._take(b) for b in sorted(first)]
        free = np.sort(np.fromiter(self._free, dtype=np.int64, count=len(self._free)))
        starts = np.flatnonzero(free[n - 1 :] - free[: len(free) - n + 1] == n - 1)  # runs free[i : i + n]
        if not len(starts):
            return [self._take(b) for b in first]
        cached = np.isin(free, np.fromiter(self._hash_of, dtype=np.int64, count=len(self._hash_of)))
        counts = np.concatenate([[0], np.cumsum(cached)])
        i = int(starts[np.argmin(counts[starts + n] - counts[starts])])
        return [self._take(int(b)) for b in free[i : i + n]]

    def _take(self, block: int) -> int:
        del self._free[block]
        old = self._hash_of.pop(block, None)
        if old is not None:  # its cached content is overwritten now
            del self._cached[old]
        self._refs[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self._refs.get(block, 0) == 0:
            del self._free[block]  # a cached block brought back from the free list
            self._refs[block] = 0
        self._refs[block] += 1

    def ref_count(self, block: int) -> int:
        return self._refs.get(block, 0)

    def free(self, block: int) -> None:
        refs = self._refs[block] - 1
        if refs:
            self._refs[block] = refs
        else:
            del self._refs[block]
            self._free[block] = None
            if block not in self._hash_of:  # warm, nothing to keep: the next to hand out
                self._free.move_to_end(block, last=False)

    # -- content cache ------------------------------------------------------
    def lookup(self, content_hash: bytes) -> int | None:
        return self._cached.get(content_hash)

    def register(self, block: int, content_hash: bytes) -> None:
        if content_hash in self._cached:
            return
        self._cached[content_hash] = block
        self._hash_of[block] = content_hash
        self._pending.append((content_hash, block))

    def commit(self) -> None:
        """The step that registered the pending hashes wrote their blocks: keep them."""
        self._pending.clear()

    def rollback(self) -> None:
        """The step that registered the pending hashes failed: forget them (the blocks hold garbage)."""
        for content_hash, block in self._pending:
            if self._cached.get(content_hash) == block:
                del self._cached[content_hash]
                del self._hash_of[block]
        self._pending.clear()


class BlockManager:
    """Allocates, forks, swaps and frees the self and cross block tables of groups."""

    def __init__(
        self, block_size: int, num_device_blocks: int, num_swap_blocks: int = 0, watermark: float = 0.0,
        enable_caching: bool = False,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.cache_stats = {"cross_queries": 0, "cross_hits": 0, "self_queries": 0, "self_block_hits": 0}
        self.device = BlockAllocator(num_device_blocks, first_id=1)  # 0 is the padding block
        self.swap = BlockAllocator(num_swap_blocks)
        self.watermark_blocks = int(watermark * num_device_blocks)
        self.block_tables: dict[int, list[int]] = {}  # decoder seq id -> self blocks
        # Group key -> cross blocks. Keyed by SequenceGroup.key, unique for the process's life, never by
        # request id (callers choose those and may reuse them).
        self.cross_block_tables: dict[int, list[int]] = {}
        self._swapped_seqs: set[int] = set()
        self._swapped_cross: set[int] = set()

    # -- queries -------------------------------------------------------------
    @property
    def num_total_device_blocks(self) -> int:
        return self.device.num_blocks

    @property
    def num_total_swap_blocks(self) -> int:
        return self.swap.num_blocks

    def get_num_free_device_blocks(self) -> int:
        return self.device.num_free

    def get_num_free_swap_blocks(self) -> int:
        return self.swap.num_free

    def get_block_table(self, seq: Sequence) -> list[int]:
        return self.block_tables[seq.seq_id]

    def get_cross_block_table(self, group: SequenceGroup) -> list[int] | None:
        return self.cross_block_tables.get(group.key)

    def group_blocks(self, group: SequenceGroup) -> int:
        """Distinct blocks the group holds now."""
        blocks = set(self.cross_block_tables.get(group.key, ()))
        for seq in group.seqs:
            blocks.update(self.block_tables.get(seq.seq_id, ()))
        return len(blocks)

    def _self_key(self, group: SequenceGroup) -> bytes | None:
        """The content-key namespace of the group's self blocks. With caching on: its encoder input
        (decoder-only prompts share one). Off: a namespace of its own when several sequences are
        prefilled together (a forked request recomputed), so they share their common prefix; those
        keys live only in one `allocate` call, never in the pool's cache."""
        if self.enable_caching:
            return group.encoder_seq.cache_key if group.encoder_seq is not None else b"decoder-only"
        if len(group.get_seqs(SequenceStatus.WAITING)) > 1:
            return b"this-request"
        return None

    def _self_hashes(self, tokens: list[int], key: bytes) -> list[bytes]:
        """Chain keys of the full blocks before the one holding the last token (it is computed for logits)."""
        bs, hashes = self.block_size, []
        previous = chain_hash(key, "self")
        for i in range((len(tokens) - 1) // bs):
            previous = chain_hash(previous, tokens[i * bs : (i + 1) * bs])
            hashes.append(previous)
        return hashes

    def prefill_need(self, group: SequenceGroup) -> tuple[int, int]:
        """(blocks, decoder tokens to compute) of the group's waiting sequences, a later sequence
        reusing the full prefix blocks an earlier one of the group computes (blocks cached by
        other groups, which `allocate` also reuses, are not counted off: an upper bound)."""
        waiting, bs = group.get_seqs(SequenceStatus.WAITING), self.block_size
        key = self._self_key(group) if len(waiting) > 1 else None  # one sequence has nothing to share
        blocks = tokens = 0
        seen: set[bytes] = set()
        for seq in waiting:
            shared = 0
            if key is not None:
                hashes = self._self_hashes(seq.data.token_ids, key)
                reusable = hashes if group.prefill_from is None else hashes[: group.prefill_from // bs]
                while shared < len(reusable) and reusable[shared] in seen:
                    shared += 1
                seen.update(hashes)
            blocks += blocks_for(len(seq), bs) - shared
            tokens += seq.num_new_tokens - shared * bs
        if group.encoder_seq is not None:
            blocks += blocks_for(group.encoder_seq.num_positions, bs)
        return blocks, tokens

    # -- allocation ----------------------------------------------------------
    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        needed = self.prefill_need(group)[0]
        if needed > self.device.num_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        if self.device.num_free - needed >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, group: SequenceGroup, chunked: bool = False) -> None:
        """Give every waiting sequence its self table and the group its cross table.

        With caching on, a group whose encoder input is already cached shares
        those cross blocks (`group.encoder_cached`: the encoder is skipped), and
        each sequence reuses the longest cached run of full self blocks with the
        same encoder input and decoder prefix (`num_computed_tokens` moves past them).
        Sequences prefilled together (a forked request recomputed after preemption)
        share their common full prefix blocks, caching on or off: the first computes
        them in this step, the others read them.

        `chunked`: the prompt (one sequence) is computed a chunk per step; its new self
        blocks become findable as each chunk writes them (`prefill_chunk`), not now.
        """
        enc = group.encoder_seq
        self_key = self._self_key(group)
        key = enc.cache_key if self.enable_caching and enc is not None else None
        if enc is not None and group.key not in self.cross_block_tables:
            n = blocks_for(enc.num_positions, self.block_size)
            hashes = [chain_hash(key, "cross", i) for i in range(n)] if key is not None else []
            cached = [self.device.lookup(h) for h in hashes]
            group.encoder_cached = bool(hashes) and all(b is not None for b in cached)
            if key is not None:
                self.cache_stats["cross_queries"] += 1
                self.cache_stats["cross_hits"] += group.encoder_cached
            if group.encoder_cached:
                for block in cached:
                    self.device.incref(block)
                self.cross_block_tables[group.key] = cached
            else:
                # Consecutive blocks where the free list allows: the CPU attention reads them in place.
                # The table is recorded before its hashes, so that an interrupt leaves nothing unowned.
                table = self.cross_block_tables[group.key] = self.device.allocate_run(n)
                for block, h in zip(table, hashes):  # computed by this group's prefill, this step
                    self.device.register(block, h)
        # Self tables after the cross table: a new self block then does not sit where the cross run would
        # start, and grows into the blocks after it (`BlockAllocator.allocate`); and the cross cache,
        # the costlier to recompute, is looked up before self blocks are taken from the free list.
        # Caching off: the forks of one request share through this map alone, gone after the call.
        scope = None if self.enable_caching else {}
        for seq in group.get_seqs(SequenceStatus.WAITING):
            self._allocate_self(seq, self_key, group.prefill_from, scope, register=not chunked)

    def prefill_chunk(self, seq: Sequence, group: SequenceGroup, num_tokens: int) -> None:
        """The step computes the next `num_tokens` of the sequence's chunked prompt (its blocks are
        allocated): the blocks it fills become findable by later requests once the step commits."""
        key = self._self_key(group) if self.enable_caching else None
        if key is None:
            return
        hashes = self._self_hashes(seq.data.token_ids, key)
        table, start = self.block_tables[seq.seq_id], seq.data.num_computed_tokens
        for index in range(start // self.block_size, min(len(hashes), (start + num_tokens) // self.block_size)):
            self.device.register(table[index], hashes[index])

    def _allocate_self(self, seq: Sequence, key, compute_from: int | None = None,
                       scope: dict[bytes, int] | None = None, register: bool = True) -> None:
        """Build the sequence's self table, reusing cached full blocks before position `compute_from`
        (default: the last token, which must be computed for its logits). With a `scope` map the
        blocks are found in and registered there instead of the pool's cache. The table is recorded
        first and grows in place: each block it takes is owned (and freed with it) at once."""
        bs = self.block_size
        table: list[int] = []
        self.block_tables[seq.seq_id] = table
        hashes: list[bytes] = []
        if key is not None:
            hashes = self._self_hashes(seq.data.token_ids, key)
            if scope is None:
                self.cache_stats["self_queries"] += 1
            reusable = hashes if compute_from is None else hashes[: compute_from // bs]
            for h in reusable:
                block = self.device.lookup(h) if scope is None else scope.get(h)
                if block is None:
                    break
                self.device.incref(block)
                table.append(block)
            if scope is None:
                self.cache_stats["self_block_hits"] += len(table)
            seq.data.num_computed_tokens = len(table) * bs
        while len(table) < blocks_for(len(seq), bs):
            table.append(self.device.allocate(table[-1] if table else None))
            index = len(table) - 1
            if register and index < len(hashes):
                if scope is None:
                    self.device.register(table[index], hashes[index])
                else:
                    scope.setdefault(hashes[index], table[index])

    def commit_step(self) -> None:
        """The step's forward succeeded: the hashes of the blocks it allocated become lasting."""
        self.device.commit()

    def rollback_step(self) -> None:
        """The step's forward failed: un-register the hashes of the blocks it allocated."""
        self.device.rollback()

    def append_need(self, group: SequenceGroup, status: SequenceStatus = SequenceStatus.RUNNING) -> int:
        """Device blocks `append_slots` takes for the group's sequences in `status` (their tables in
        the swap pool for SWAPPED): a new block at a block boundary, and a copy for each writer of a
        shared block but the last, when no other group holds it too."""
        pool = self.swap if status == SequenceStatus.SWAPPED else self.device
        need = 0
        writers: dict[int, int] = {}  # shared block -> sequences of this group writing into it
        for seq in group.get_seqs(status):
            table = self.block_tables[seq.seq_id]
            need += max(0, blocks_for(len(seq), self.block_size) - len(table))
            idx = seq.data.num_computed_tokens // self.block_size
            if idx < len(table) and pool.ref_count(table[idx]) > 1:
                writers[table[idx]] = writers.get(table[idx], 0) + 1
        for block, n in writers.items():
            need += n - (pool.ref_count(block) == n)
        return need

    def can_append_slots(self, group: SequenceGroup) -> bool:
        return self.append_need(group) <= self.device.num_free

    def can_ever_append_slots(self, group: SequenceGroup) -> bool:
        """False when the group's next step needs more blocks than the whole pool, even empty of others."""
        return self.group_blocks(group) + self.append_need(group) <= self.device.num_blocks - self.watermark_blocks

    def append_slots(self, seq: Sequence) -> tuple[int, int] | None:
        """Make room for the sequence's uncached tokens.

        Returns a (src, dst) block copy when the block the next token lands in
        was shared with a forked sequence (copy-on-write), else None.
        """
        table = self.block_tables[seq.seq_id]
        while len(table) < blocks_for(len(seq), self.block_size):
            table.append(self.device.allocate(table[-1] if table else None))
        # The block that receives the first uncached token.
        idx = seq.data.num_computed_tokens // self.block_size
        block = table[idx]
        if self.device.ref_count(block) == 1:
            return None
        new = self.device.allocate()
        self.device.free(block)
        table[idx] = new
        return block, new

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (and the group's cross table)."""
        table = self.block_tables[parent.seq_id]
        for block in table:
            self.device.incref(block)
        self.block_tables[child.seq_id] = list(table)

    # -- swapping ------------------------------------------------------------
    def _swap(self, group: SequenceGroup, status: SequenceStatus, src: BlockAllocator, dst: BlockAllocator,
              to_swap: bool) -> dict[int, int]:
        mapping: dict[int, int] = {}

        def move(table: list[int]) -> list[int]:
            new_table = []
            for block in table:
                if block in mapping:
                    dst.incref(mapping[block])
                else:
                    mapping[block] = dst.allocate()
                src.free(block)
                new_table.append(mapping[block])
            return new_table

        for seq in group.get_seqs(status):
            self.block_tables[seq.seq_id] = move(self.block_tables[seq.seq_id])
            (self._swapped_seqs.add if to_swap else self._swapped_seqs.discard)(seq.seq_id)
        key = group.key
        if key in self.cross_block_tables:
            self.cross_block_tables[key] = move(self.cross_block_tables[key])
            (self._swapped_cross.add if to_swap else self._swapped_cross.discard)(key)
        return mapping

    def can_swap_out(self, group: SequenceGroup) -> bool:
        return self.group_blocks(group) <= self.swap.num_free

    def can_swap_in(self, group: SequenceGroup) -> AllocStatus:
        key = group.key
        swapped = set(self.cross_block_tables.get(key, ()) if key in self._swapped_cross else ())
        for seq in group.get_seqs(SequenceStatus.SWAPPED):
            swapped.update(self.block_tables[seq.seq_id])
        needed = len(swapped) + self.append_need(group, SequenceStatus.SWAPPED)
        if needed > self.device.num_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        return AllocStatus.OK if self.device.num_free - needed >= self.watermark_blocks else AllocStatus.LATER

    def swap_out(self, group: SequenceGroup) -> dict[int, int]:
        """Move the running sequences' and cross blocks to swap; returns device -> swap ids."""
        return self._swap(group, SequenceStatus.RUNNING, self.device, self.swap, to_swap=True)

    def swap_in(self, group: SequenceGroup) -> dict[int, int]:
        """Move the swapped sequences' and cross blocks back; returns swap -> device ids."""
        return self._swap(group, SequenceStatus.SWAPPED, self.swap, self.device, to_swap=False)

    # -- freeing -------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Release a sequence's self table (from whichever pool it lives in)."""
        self._release(self.block_tables.pop(seq.seq_id, None), seq.seq_id, self._swapped_seqs)

    def free_cross(self, group: SequenceGroup) -> None:
        """Release a group's cross table (from whichever pool it lives in)."""
        self._release(self.cross_block_tables.pop(group.key, None), group.key, self._swapped_cross)

    def _release(self, table: list[int] | None, key, swapped: set) -> None:
        if table is None:
            return
        pool = self.swap if key in swapped else self.device
        swapped.discard(key)
        for block in reversed(table):  # the pool hands freed blocks out last-first: the table's order again
            pool.free(block)

    def free_group(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            self.free(seq)
        self.free_cross(group)

    def reset(self) -> None:
        for key in self.cache_stats:
            self.cache_stats[key] = 0
        self.device.reset()
        self.swap.reset()
        self.block_tables.clear()
        self.cross_block_tables.clear()
        self._swapped_seqs.clear()
        self._swapped_cross.clear()
