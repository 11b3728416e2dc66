"""Continuous batching: waiting / running / swapped queues under token and sequence budgets.

A step is either a prefill step (new or recomputed requests: encoder plus
decoder prompt) or a decode step (one token for every running sequence).
Prefills go first, so requests that arrive while others decode join the
running batch at the next step. When the KV pool runs out during decode, the
newest running group is preempted: swapped to the CPU pool when there is room
and swapping is enabled, otherwise freed and recomputed later.

With chunked prefill (`SchedulerConfig.chunked_prefill`) a step mixes both:
every decoding sequence gets its token, and what is left of the token budget
goes to prefills, a decoder prompt longer than that being computed a chunk per
step (the encoder with its first chunk). A long prompt then never stalls the
others' decoding, and a prompt longer than the budget is served, not refused.

    step   [decode rows: 1 token each][chunk of A's prompt][B's encoder + first chunk]
           |<------------------ max_num_batched_tokens ------------------------->|

A request is admitted only while the pool also has room for what the
running sequences will still write: each is expected to generate the share
of its remaining `max_tokens` that recently finished sequences used (all of
it until some have finished), and the blocks that takes are held back. A
preempted request is recomputed, encoder and all, so on a CPU a batch that
outgrows the pool costs more than a smaller one: T5-base, 256 requests of 64
tokens in a 2 GiB pool admitted 184 at once and preempted 41 of them
(31.0 s); held back, it ran in waves of 131-142 and preempted none (28.7 s).
The first request is always admitted; preemption stays the fallback when the
estimate falls short.

The scheduler barely knows encoders exist: a group's cross blocks are
allocated, swapped and freed with it, and an encoder's positions count
against the prefill token budget.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field

from encdec_engine.engine.block_manager import AllocStatus, BlockManager, blocks_for
from encdec_engine.sequence import SequenceStatus
from encdec_engine.engine.sequence_group import Sequence, SequenceGroup
from encdec_engine.worker.step_input import SequenceGroupMetadata


class PreemptionMode(enum.Enum):
    RECOMPUTE = enum.auto()
    SWAP = enum.auto()


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # sequences in one step
    max_num_batched_tokens: int = 16384  # decoder + encoder positions in one prefill step
    preemption_mode: PreemptionMode | None = None  # None: swap when possible, else recompute
    chunked_prefill: bool = False  # mixed steps: decodes first, prefill chunks in the budget left
    reserve_decode_growth: bool = True  # admit while the running sequences' expected growth fits (above)


@dataclass
class SchedulerOutput:
    groups: list[SequenceGroup] = field(default_factory=list)
    is_prompt: bool = False  # prefills only (all of them with chunked prefill off)
    # Chunked prefill: the prefill groups of the step (the rest of `groups` decode) and, per group key,
    # the decoder tokens its chunk computes (absent: the whole rest of its prompt).
    prefills: list[SequenceGroup] = field(default_factory=list)
    chunk_sizes: dict[int, int] = field(default_factory=dict)
    continued: set[int] = field(default_factory=set)  # group keys of prompts under way (cross KV written)
    num_batched_tokens: int = 0
    # (source, destination) pairs, not dicts: groups that share a device block (cached prefixes)
    # each swap out their own copy of it.
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    ignored: list[SequenceGroup] = field(default_factory=list)  # can never fit the pool: finished as "length"
    # Groups whose blocks this step's swaps move: should a swap fail, their KV is lost with it.
    swapped_in: list[SequenceGroup] = field(default_factory=list)
    swapped_out: list[SequenceGroup] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.groups


class GrowthEstimate:
    """The share of its remaining token budget (`max_len` less its length) a decoding sequence is
    expected to still generate: the mean share the last `window` finished sequences used of theirs,
    1.0 before any has finished."""

    def __init__(self, window: int = 64) -> None:
        self.shares: deque[float] = deque(maxlen=window)

    @property
    def ratio(self) -> float:
        return sum(self.shares) / len(self.shares) if self.shares else 1.0

    def finished(self, group: SequenceGroup) -> None:
        if group.max_len is None:
            return
        for seq in group.seqs:
            allowed = group.max_len - len(seq.data.prompt_token_ids)
            if allowed > 0 and seq.status in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH_CAPPED):
                self.shares.append(min(1.0, len(seq.data.output_token_ids) / allowed))

    def blocks(self, group: SequenceGroup, seqs: list[Sequence], block_size: int, ratio: float) -> int:
        """Blocks the sequences are expected to add before they finish."""
        if group.max_len is None:
            return 0
        return sum(blocks_for(len(s) + math.ceil(ratio * max(0, group.max_len - len(s))), block_size)
                   - blocks_for(len(s), block_size) for s in seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.growth = GrowthEstimate()
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] = deque()
        self.num_preemptions = 0
        self._under_way: set[int] = set()  # keys of running groups in a chunked prefill

    # -- queue management ----------------------------------------------------
    def add(self, group: SequenceGroup) -> None:
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def abort(self, request_id: str) -> SequenceGroup | None:
        """Remove a request wherever it is and free its self and cross blocks at once."""
        for queue in (self.waiting, self.running, self.swapped):
            for group in queue:
                if group.request_id == request_id:
                    for seq in group.unfinished_seqs():
                        seq.status = SequenceStatus.FINISHED_ABORTED
                    self.remove(group)
                    return group
        return None

    def remove(self, group: SequenceGroup) -> None:
        """Take a group out of whichever queue holds it and free its blocks (both idempotent)."""
        for queue in (self.waiting, self.running, self.swapped):
            if group in queue:
                queue.remove(group)
        self._under_way.discard(group.key)
        self.block_manager.free_group(group)

    def free_finished(self) -> list[SequenceGroup]:
        """Drop finished groups from the running queue, freeing their blocks."""
        done = [g for g in self.running if g.is_finished()]
        if done:
            self.running = [g for g in self.running if not g.is_finished()]
            for group in done:
                self._under_way.discard(group.key)
                self.block_manager.free_group(group)
                self.growth.finished(group)
        return done

    def _growth_reserve(self) -> tuple[float, int]:
        """(the growth ratio, blocks the running sequences are expected to add)."""
        ratio, bs = self.growth.ratio, self.block_manager.block_size
        return ratio, sum(self.growth.blocks(g, g.get_seqs(SequenceStatus.RUNNING), bs, ratio) for g in self.running)

    def _room_for(self, group: SequenceGroup, n: int, ratio: float, reserve: int) -> tuple[bool, int]:
        """Whether admitting the waiting `group` (n sequences once forked) leaves the pool room for the
        running sequences' expected growth and its own; and the reserve with it admitted. Always
        True with nothing running, so that one request at least goes ahead."""
        if not self.config.reserve_decode_growth:
            return True, reserve
        waiting = group.get_seqs(SequenceStatus.WAITING)
        own = self.growth.blocks(group, waiting[:1], self.block_manager.block_size, ratio) * n
        if not self.running:
            return True, reserve + own
        need = self.block_manager.prefill_need(group)[0]
        return self.block_manager.get_num_free_device_blocks() - need >= reserve + own, reserve + own

    # -- scheduling ----------------------------------------------------------
    def schedule(self) -> tuple[list[SequenceGroupMetadata], SchedulerOutput]:
        out = SchedulerOutput()
        if self.config.chunked_prefill:
            self._schedule_mixed(out)
            prefills = {id(g) for g in out.prefills}
            return [self._metadata(g, id(g) in prefills, out.chunk_sizes.get(g.key), g.key in out.continued)
                    for g in out.groups], out
        if not self.swapped:
            self._schedule_prefills(out)
        if out.is_empty:
            self._schedule_decodes(out)
        out.prefills = list(out.groups) if out.is_prompt else []
        return [self._metadata(g, out.is_prompt) for g in out.groups], out

    # -- chunked prefill: mixed steps --------------------------------------------
    def prefilling(self, group: SequenceGroup) -> bool:
        """Running with part of its prompt still to compute (a chunked prefill under way)."""
        return group.key in self._under_way

    def _schedule_mixed(self, out: SchedulerOutput) -> None:
        """Decodes first (as `_schedule_decodes`), then prefill chunks in the tokens left: the chunks of
        prompts under way, then new requests, each as much of its prompt as fits. Computed only whole:
        a forked request recomputed, and one whose probes read its whole prompt (prompt logprobs,
        cross-attention); an encoder always is."""
        under_way = [g for g in self.running if self.prefilling(g)]
        self.running = [g for g in self.running if not self.prefilling(g)]
        self._schedule_decodes(out)
        self.running += under_way
        limit = self.config.max_num_batched_tokens
        budget = limit - out.num_batched_tokens
        num_seqs = out.num_batched_tokens + len(under_way)
        for group in under_way:  # allocated already: the next chunk of its prompt, if a token fits
            if budget <= 0:
                break
            seq = group.get_seqs(SequenceStatus.RUNNING)[0]
            chunk = min(seq.num_new_tokens, budget)
            self.block_manager.prefill_chunk(seq, group, chunk)
            self._add_prefill(out, group, seq, chunk, continued=True)
            budget -= chunk
        ratio, reserve = self._growth_reserve()
        while self.waiting and budget > 0 and not self.swapped:
            group = self.waiting[0]
            status = self.block_manager.can_allocate(group)
            encoder = group.encoder_seq.num_positions if group.encoder_seq is not None else 0
            cost = self._prefill_cost(group)
            whole = len(group.seqs) > 1 or group.prefill_from == 0
            if status == AllocStatus.NEVER or (cost > limit if whole else encoder >= limit):
                self.waiting.popleft()
                self._ignore(group, out)
                continue
            n = group.num_unfinished_seqs()
            if len(group.seqs) == 1:
                n = max(n, group.sampling_params.best_of, group.sampling_params.num_beams)
            fits = cost <= budget or (not whole and encoder < budget)
            if status == AllocStatus.LATER or num_seqs + n > self.config.max_num_seqs or not fits:
                break
            room, with_group = self._room_for(group, n, ratio, reserve)
            if not room:
                break
            reserve = with_group
            self.waiting.popleft()
            self.block_manager.allocate(group, chunked=not whole)
            for seq in group.get_seqs(SequenceStatus.WAITING):
                seq.status = SequenceStatus.RUNNING
            self.running.append(group)
            seq = group.get_seqs(SequenceStatus.RUNNING)[0]
            encoder = 0 if group.encoder_cached else encoder
            chunk = seq.num_new_tokens if whole else min(seq.num_new_tokens, budget - encoder)
            if not whole:
                self.block_manager.prefill_chunk(seq, group, chunk)
            self._add_prefill(out, group, seq, chunk)
            budget -= encoder + (cost - encoder if whole else chunk)
            num_seqs += n
        out.num_batched_tokens = limit - budget
        out.is_prompt = bool(out.prefills) and len(out.prefills) == len(out.groups)

    def _add_prefill(self, out: SchedulerOutput, group: SequenceGroup, seq: Sequence, chunk: int,
                     continued: bool = False) -> None:
        """Schedule `chunk` of the group's prompt tokens (prefills first in the step, decodes after)."""
        out.groups.insert(len(out.prefills), group)
        out.prefills.append(group)
        if continued:
            out.continued.add(group.key)
        if chunk < seq.num_new_tokens:
            out.chunk_sizes[group.key] = chunk
            self._under_way.add(group.key)
        else:
            self._under_way.discard(group.key)

    def _prefill_cost(self, group: SequenceGroup) -> int:
        cost = self.block_manager.prefill_need(group)[1]
        if group.encoder_seq is not None:
            cost += group.encoder_seq.num_positions
        return cost

    def _schedule_prefills(self, out: SchedulerOutput) -> None:
        num_seqs = sum(g.num_unfinished_seqs() for g in self.running)
        ratio, reserve = self._growth_reserve()
        while self.waiting:
            group = self.waiting[0]
            cost = self._prefill_cost(group)
            status = self.block_manager.can_allocate(group)
            if status == AllocStatus.NEVER or cost > self.config.max_num_batched_tokens:
                self.waiting.popleft()
                self._ignore(group, out)
                continue
            n = group.num_unfinished_seqs()
            if len(group.seqs) == 1:  # not forked yet: it will run best_of samples or num_beams beams
                n = max(n, group.sampling_params.best_of, group.sampling_params.num_beams)
            if (
                status == AllocStatus.LATER
                or out.num_batched_tokens + cost > self.config.max_num_batched_tokens
                or num_seqs + n > self.config.max_num_seqs
            ):
                break
            room, with_group = self._room_for(group, n, ratio, reserve)
            if not room:
                break
            reserve = with_group
            self.waiting.popleft()
            self.block_manager.allocate(group)
            if group.encoder_cached:
                out.num_batched_tokens -= group.encoder_seq.num_positions
            for seq in group.get_seqs(SequenceStatus.WAITING):
                seq.status = SequenceStatus.RUNNING
            self.running.append(group)
            out.groups.append(group)
            out.num_batched_tokens += cost
            num_seqs += n
        out.is_prompt = bool(out.groups)

    def _schedule_decodes(self, out: SchedulerOutput) -> None:
        self._swap_in(out)
        running: list[SequenceGroup] = []
        queue = deque(self.running)
        num_seqs = 0
        while queue:
            group = queue.popleft()
            n = len(group.get_seqs(SequenceStatus.RUNNING))
            if num_seqs + n > self.config.max_num_seqs:
                running.append(group)  # over the sequence budget: waits for the next step
                continue
            fits = self.block_manager.can_append_slots(group)
            if not fits and not self.block_manager.can_ever_append_slots(group):
                self._ignore(group, out)  # it has outgrown the pool: nothing to preempt would help
                continue
            while not fits:
                # Preempt the newest group; if that is this one, stop here.
                victim = queue.pop() if queue else group
                self._preempt(victim, out)
                if victim is group:
                    break
                fits = self.block_manager.can_append_slots(group)
            else:
                # Append right away so the next group's check sees the blocks taken.
                for seq in group.get_seqs(SequenceStatus.RUNNING):
                    copy = self.block_manager.append_slots(seq)
                    if copy is not None:
                        out.blocks_to_copy.append(copy)
                running.append(group)
                out.groups.append(group)
                num_seqs += n
        self.running = running
        out.num_batched_tokens = num_seqs

    def _swap_in(self, out: SchedulerOutput) -> None:
        while self.swapped:
            group = self.swapped[0]
            status = self.block_manager.can_swap_in(group)
            if status == AllocStatus.NEVER:
                self.swapped.popleft()
                self._ignore(group, out)
                continue
            if status == AllocStatus.LATER:
                break
            self.swapped.popleft()
            out.swapped_in.append(group)
            out.blocks_to_swap_in.extend(self.block_manager.swap_in(group).items())
            for seq in group.get_seqs(SequenceStatus.SWAPPED):
                seq.status = SequenceStatus.RUNNING
            self.running.append(group)

    def _ignore(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """End a group that can never fit the pool ("length": it keeps the tokens it has)."""
        for seq in group.unfinished_seqs():
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
        self.block_manager.free_group(group)
        out.ignored.append(group)

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        self.num_preemptions += 1
        out.num_preempted += 1
        mode = self.config.preemption_mode
        if mode is None:
            can_swap = self.block_manager.num_total_swap_blocks and self.block_manager.can_swap_out(group)
            mode = PreemptionMode.SWAP if can_swap else PreemptionMode.RECOMPUTE
        if mode == PreemptionMode.SWAP and self.block_manager.can_swap_out(group):
            out.swapped_out.append(group)
            out.blocks_to_swap_out.extend(self.block_manager.swap_out(group).items())
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(group)
            return
        self.block_manager.free_group(group)
        for seq in group.unfinished_seqs():
            seq.reset_for_recompute()
        self.waiting.appendleft(group)

    def _metadata(self, group: SequenceGroup, is_prompt: bool, chunk: int | None = None,
                  continued: bool = False) -> SequenceGroupMetadata:
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        params = group.sampling_params
        # A request that forks does so at its first token, sampled by its prefill's last chunk.
        first_prefill = is_prompt and len(group.seqs) == 1 and chunk is None
        return SequenceGroupMetadata(
            request_id=group.request_id,
            is_prompt=is_prompt,
            seq_data={s.seq_id: s.data for s in seqs},
            sampling_params=params,
            block_tables={s.seq_id: self.block_manager.get_block_table(s) for s in seqs},
            encoder_seq_data=group.encoder_seq,
            cross_block_table=self.block_manager.get_cross_block_table(group),
            encoder_cached=group.encoder_cached or continued,  # a later chunk: its first one wrote the cross KV
            token_chunk_size=chunk,
            sampling=group.sampling,
            max_len=group.max_len,
            fanout=params.best_of if first_prefill and params.best_of > 1 and not params.use_beam_search else 1,
            probes=group.unreported_probes if is_prompt else None,
        )
