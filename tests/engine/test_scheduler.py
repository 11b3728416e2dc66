"""Scheduler behaviour without a model: continuous batching, budgets, preemption, abort."""

import pytest

from encdec_engine.engine.block_manager import BlockManager
from encdec_engine.engine.scheduler import PreemptionMode, Scheduler, SchedulerConfig
from encdec_engine.sequence import EncoderSequence, SequenceStatus
from encdec_engine.engine.sequence_group import Sequence, SequenceGroup
from encdec_engine.sampling_params import SamplingParams

BS = 4
_ids = iter(range(10**6))


def make_group(rid: str, dec_len: int = 2, enc_len: int | None = 8) -> SequenceGroup:
    enc = EncoderSequence(num_positions=enc_len) if enc_len else None
    return SequenceGroup(rid, [Sequence(next(_ids), [2] * dec_len)], SamplingParams(), 0.0, enc)


def fake_step(scheduler: Scheduler, metadata) -> None:
    """What the engine does after a forward pass: mark tokens computed, append one."""
    for m in metadata:
        for data in m.seq_data.values():
            data.num_computed_tokens = len(data)
            data.output_token_ids.append(5)


def finish(group: SequenceGroup) -> None:
    for s in group.seqs:
        s.status = SequenceStatus.FINISHED_STOPPED


def test_prefill_then_decode_and_new_arrivals_join():
    bm = BlockManager(BS, 64)
    s = Scheduler(SchedulerConfig(), bm)
    a, b = make_group("a"), make_group("b")
    s.add(a)
    s.add(b)
    meta, out = s.schedule()
    assert out.is_prompt and [m.request_id for m in meta] == ["a", "b"]
    assert meta[0].cross_block_table == bm.get_cross_block_table(a) and meta[0].encoder_seq_data is a.encoder_seq
    fake_step(s, meta)
    meta, out = s.schedule()
    assert not out.is_prompt and len(meta) == 2 and out.num_batched_tokens == 2
    fake_step(s, meta)
    s.add(make_group("c"))  # arrives while a and b decode
    meta, out = s.schedule()
    assert out.is_prompt and [m.request_id for m in meta] == ["c"]
    fake_step(s, meta)
    meta, out = s.schedule()
    assert [m.request_id for m in meta] == ["a", "b", "c"]  # c joined the running batch


def test_token_and_sequence_budgets():
    bm = BlockManager(BS, 256)
    s = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=25), bm)
    for i in range(5):
        s.add(make_group(f"r{i}", dec_len=2, enc_len=8))  # cost 10 each
    meta, out = s.schedule()
    assert [m.request_id for m in meta] == ["r0", "r1"] and out.num_batched_tokens == 20
    fake_step(s, meta)
    meta, out = s.schedule()
    assert [m.request_id for m in meta] == ["r2"]  # max_num_seqs=3 reached
    fake_step(s, meta)
    meta, out = s.schedule()
    assert not out.is_prompt and len(meta) == 3


def test_request_larger_than_pool_is_ignored_not_stuck():
    bm = BlockManager(BS, 4)
    s = Scheduler(SchedulerConfig(), bm)
    g = make_group("huge", dec_len=2, enc_len=40)
    s.add(g)
    meta, out = s.schedule()
    assert not meta and out.ignored == [g] and not s.has_unfinished()
    assert bm.get_num_free_device_blocks() == 4


def test_preemption_by_recompute_frees_self_and_cross():
    bm = BlockManager(BS, 6)  # each group: 1 self + 2 cross blocks
    s = Scheduler(SchedulerConfig(preemption_mode=PreemptionMode.RECOMPUTE), bm)
    a, b = make_group("a", dec_len=4), make_group("b", dec_len=4)
    s.add(a)
    s.add(b)
    meta, _ = s.schedule()
    fake_step(s, meta)  # both now have 5 tokens: position 4 needs a 2nd self block each
    assert bm.get_num_free_device_blocks() == 0
    meta, out = s.schedule()
    assert out.num_preempted == 1 and [m.request_id for m in meta] == ["a"]
    assert s.waiting[0] is b and b.seqs[0].status == SequenceStatus.WAITING
    assert b.seqs[0].data.num_computed_tokens == 0 and b.key not in bm.cross_block_tables
    fake_step(s, meta)
    finish(a)
    s.free_finished()
    meta, out = s.schedule()  # b is recomputed: prompt + the token it had generated
    assert out.is_prompt and meta[0].request_id == "b" and b.seqs[0].num_new_tokens == 5
    fake_step(s, meta)
    finish(b)
    s.free_finished()
    assert bm.get_num_free_device_blocks() == 6


def test_preemption_by_swap_and_resume_in_order():
    bm = BlockManager(BS, 6, num_swap_blocks=12)
    s = Scheduler(SchedulerConfig(), bm)
    a, b = make_group("a", dec_len=4), make_group("b", dec_len=4)
    s.add(a)
    s.add(b)
    fake_step(s, s.schedule()[0])
    meta, out = s.schedule()
    assert out.blocks_to_swap_out and b in s.swapped and b.seqs[0].status == SequenceStatus.SWAPPED
    assert bm.get_num_free_swap_blocks() == 12 - 3
    fake_step(s, meta)
    finish(a)
    s.free_finished()
    meta, out = s.schedule()  # b swaps back in and keeps decoding (no recompute)
    assert out.blocks_to_swap_in and [m.request_id for m in meta] == ["b"] and not out.is_prompt
    fake_step(s, meta)
    finish(b)
    s.free_finished()
    assert bm.get_num_free_device_blocks() == 6 and bm.get_num_free_swap_blocks() == 12


def test_abort_frees_self_and_cross_at_once():
    bm = BlockManager(BS, 32)
    s = Scheduler(SchedulerConfig(), bm)
    a, b = make_group("a"), make_group("b")
    s.add(a)
    s.add(b)
    fake_step(s, s.schedule()[0])
    used_by_a = bm.group_blocks(a)
    free = bm.get_num_free_device_blocks()
    assert s.abort("a") is a
    assert bm.get_num_free_device_blocks() == free + used_by_a
    assert a.seqs[0].status == SequenceStatus.FINISHED_ABORTED
    assert s.abort("missing") is None
    s.abort("b")
    assert bm.get_num_free_device_blocks() == 32 and not s.has_unfinished()


def test_decode_takes_a_block_only_at_a_block_boundary():
    bm = BlockManager(BS, 3)  # 1 self + 2 cross: the pool is full after prefill
    s = Scheduler(SchedulerConfig(preemption_mode=PreemptionMode.RECOMPUTE), bm)
    g = make_group("g", dec_len=2)
    s.add(g)
    fake_step(s, s.schedule()[0])  # positions 2 and 3 still land in the first block
    for _ in range(2):
        meta, out = s.schedule()
        assert [m.request_id for m in meta] == ["g"] and not out.num_preempted and not out.ignored
        fake_step(s, meta)
    meta, out = s.schedule()  # position 4 needs a block the pool can never give: ended, not stuck
    assert not meta and out.ignored == [g] and g.seqs[0].status == SequenceStatus.FINISHED_LENGTH_CAPPED
    assert not s.has_unfinished() and bm.get_num_free_device_blocks() == 3


def _grown(rid: str, max_tokens: int = 10) -> SequenceGroup:
    """enc 8 (2 cross blocks) + decoder prompt 2 (1 self block), allowed 10 more tokens (2 more blocks)."""
    return SequenceGroup(rid, [Sequence(next(_ids), [2] * 2)], SamplingParams(max_tokens=max_tokens), 0.0,
                         EncoderSequence(num_positions=8), max_len=2 + max_tokens)


def _run(s: Scheduler, stop_after: int | None = None) -> list[list[str]]:
    """Step until done (each sequence stopping after `stop_after` outputs, else at max_len); the ids of
    each step's groups."""
    steps = []
    while s.has_unfinished():
        meta, _ = s.schedule()
        steps.append([m.request_id for m in meta])
        fake_step(s, meta)
        for g in s.running:
            seq = g.seqs[0]
            if len(seq) >= g.max_len or (stop_after is not None and len(seq.data.output_token_ids) >= stop_after):
                finish(g)
        s.free_finished()
    return steps


def test_admission_holds_back_room_for_the_running_sequences_growth():
    # 16 blocks: five prompts fit (3 blocks each), three grown requests do (5 each)
    held = Scheduler(SchedulerConfig(), BlockManager(BS, 16))
    optimistic = Scheduler(SchedulerConfig(reserve_decode_growth=False), BlockManager(BS, 16))
    for s in (held, optimistic):
        for i in range(6):
            s.add(_grown(f"r{i}"))
    steps = _run(held)
    assert steps[0] == ["r0", "r1", "r2"] and held.num_preemptions == 0
    assert held.block_manager.get_num_free_device_blocks() == 16
    steps = _run(optimistic)  # vLLM's rule: admits five, then preempts as they grow
    assert steps[0] == ["r0", "r1", "r2", "r3", "r4"] and optimistic.num_preemptions > 0


def test_growth_estimate_learns_the_share_finished_sequences_used():
    s = Scheduler(SchedulerConfig(), BlockManager(BS, 16))
    assert s.growth.ratio == 1.0  # nothing finished yet: every sequence may use all of its tokens
    for i in range(3):
        s.add(_grown(f"a{i}"))
    _run(s, stop_after=4)  # each stopped after 4 of its 10 tokens
    assert s.growth.ratio == pytest.approx(0.4)
    for i in range(6):
        s.add(_grown(f"b{i}"))
    meta, _ = s.schedule()
    assert [m.request_id for m in meta] == ["b0", "b1", "b2", "b3"]  # 4 x (3 + 1 expected): more than 3
    assert s.num_preemptions == 0


def test_the_first_request_is_admitted_whatever_its_growth():
    s = Scheduler(SchedulerConfig(), BlockManager(BS, 4))  # its prompt fits, its growth does not
    g = _grown("only", max_tokens=40)
    s.add(g)
    meta, out = s.schedule()
    assert out.is_prompt and [m.request_id for m in meta] == ["only"]
