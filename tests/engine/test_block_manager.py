"""Block manager accounting: the formulas of the encoder/decoder memory-management notes."""

import pytest

from encdec_engine.engine.block_manager import AllocStatus, BlockAllocator, BlockManager, blocks_for
from encdec_engine.sequence import EncoderSequence, SequenceStatus
from encdec_engine.engine.sequence_group import Sequence, SequenceGroup
from encdec_engine.sampling_params import SamplingParams

BS = 4


def group(rid: str, dec_len: int, enc_len: int | None, seq_id: int) -> SequenceGroup:
    enc = EncoderSequence(num_positions=enc_len) if enc_len is not None else None
    return SequenceGroup(rid, [Sequence(seq_id, list(range(dec_len)))], SamplingParams(), 0.0, enc)


def group_blocks(dec_len: int, enc_len: int | None) -> int:
    return blocks_for(dec_len, BS) + (blocks_for(enc_len, BS) if enc_len else 0)


def test_allocate_free_and_free_cross():
    bm = BlockManager(BS, num_device_blocks=32)
    g = group("a", dec_len=6, enc_len=9, seq_id=0)
    free = bm.get_num_free_device_blocks()
    assert bm.can_allocate(g) == AllocStatus.OK
    bm.allocate(g)
    assert bm.get_num_free_device_blocks() == free - group_blocks(6, 9)  # free_after_alloc
    assert len(bm.get_cross_block_table(g)) == 3 and len(bm.get_block_table(g.seqs[0])) == 2
    assert 0 not in bm.get_block_table(g.seqs[0]) + bm.get_cross_block_table(g)  # block 0 is padding
    free = bm.get_num_free_device_blocks()
    bm.free(g.seqs[0])
    assert bm.get_num_free_device_blocks() == free + 2  # + |self table|
    free = bm.get_num_free_device_blocks()
    bm.free_cross(g)
    assert bm.get_num_free_device_blocks() == free + 3  # + |cross table|
    assert bm.get_num_free_device_blocks() == 32


def test_decoder_only_group_has_no_cross_table():
    bm = BlockManager(BS, 8)
    g = group("a", 5, None, 0)
    bm.allocate(g)
    assert bm.get_cross_block_table(g) is None
    assert bm.get_num_free_device_blocks() == 8 - 2


def test_can_allocate_later_and_never():
    bm = BlockManager(BS, 6)
    assert bm.can_allocate(group("big", 4, 30, 0)) == AllocStatus.NEVER  # 1 + 8 > 6
    bm.allocate(group("a", 4, 12, 1))  # 1 + 3 blocks
    assert bm.can_allocate(group("b", 4, 12, 2)) == AllocStatus.LATER
    assert bm.can_allocate(group("c", 4, 4, 3)) == AllocStatus.OK


def test_append_slots_grows_by_one_block_at_boundaries():
    bm = BlockManager(BS, 16)
    g = group("a", 4, 4, 0)
    seq = g.seqs[0]
    bm.allocate(g)
    seq.status = SequenceStatus.RUNNING
    seq.data.num_computed_tokens = 4
    seq.append_token(7, 0.0, None)  # 5 tokens: needs a 2nd block
    free = bm.get_num_free_device_blocks()
    assert bm.can_append_slots(g)
    assert bm.append_slots(seq) is None
    assert bm.get_num_free_device_blocks() == free - 1
    seq.data.num_computed_tokens = 5
    seq.append_token(8, 0.0, None)  # 6 tokens: same block
    assert bm.append_slots(seq) is None
    assert bm.get_num_free_device_blocks() == free - 1


def test_fork_shares_blocks_and_copy_on_write():
    bm = BlockManager(BS, 16)
    g = group("a", 6, 4, 0)
    parent = g.seqs[0]
    bm.allocate(g)
    child = Sequence(1, list(range(6)))
    g.seqs.append(child)
    free = bm.get_num_free_device_blocks()
    bm.fork(parent, child)
    assert bm.get_num_free_device_blocks() == free  # shared, nothing new
    assert bm.get_block_table(child) == bm.get_block_table(parent)
    for s in (parent, child):
        s.status = SequenceStatus.RUNNING
        s.data.num_computed_tokens = 6
        s.append_token(9, 0.0, None)  # 7th token lands in the shared partial block
    src, dst = bm.append_slots(child)
    assert src == bm.get_block_table(parent)[1] and dst == bm.get_block_table(child)[1] and src != dst
    assert bm.get_num_free_device_blocks() == free - 1
    assert bm.append_slots(parent) is None  # now sole owner
    bm.free_group(g)
    assert bm.get_num_free_device_blocks() == 16


def test_swap_out_and_in_accounting():
    bm = BlockManager(BS, num_device_blocks=16, num_swap_blocks=16)
    g = group("a", 7, 10, 0)
    bm.allocate(g)
    g.seqs[0].status = SequenceStatus.RUNNING
    n = group_blocks(7, 10)
    gpu, cpu = bm.get_num_free_device_blocks(), bm.get_num_free_swap_blocks()
    mapping = bm.swap_out(g)
    assert len(mapping) == n
    assert bm.get_num_free_device_blocks() == gpu + n and bm.get_num_free_swap_blocks() == cpu - n
    g.seqs[0].status = SequenceStatus.SWAPPED
    gpu, cpu = bm.get_num_free_device_blocks(), bm.get_num_free_swap_blocks()
    assert bm.can_swap_in(g) == AllocStatus.OK
    bm.swap_in(g)
    assert bm.get_num_free_device_blocks() == gpu - n and bm.get_num_free_swap_blocks() == cpu + n


def test_free_while_swapped_returns_blocks_to_swap_pool():
    bm = BlockManager(BS, 16, 16)
    g = group("a", 7, 10, 0)
    bm.allocate(g)
    g.seqs[0].status = SequenceStatus.RUNNING
    bm.swap_out(g)
    bm.free_group(g)
    assert bm.get_num_free_device_blocks() == 16 and bm.get_num_free_swap_blocks() == 16


def test_reset_frees_everything():
    bm = BlockManager(BS, 16, 8)
    for i in range(3):
        bm.allocate(group(f"r{i}", 5, 6, i))
    bm.reset()
    assert bm.get_num_free_device_blocks() == 16 and bm.get_num_free_swap_blocks() == 8
    assert not bm.block_tables and not bm.cross_block_tables


@pytest.mark.parametrize("n_tokens,expected", [(0, 0), (1, 1), (4, 1), (5, 2), (16, 4)])
def test_blocks_for(n_tokens, expected):
    assert blocks_for(n_tokens, BS) == expected


def test_append_need_counts_one_copy_less_than_the_writers_of_a_shared_block():
    """Two forks write into their shared partial block: one copies, the last writes in place."""
    from encdec_engine.sampling_params import SamplingParams
    from encdec_engine.engine.sequence_group import Sequence, SequenceGroup
    from encdec_engine.sequence import SequenceStatus

    bm = BlockManager(4, 8)
    parent = Sequence(1, [5, 6, 7, 8, 9])  # 2 blocks, the second partial
    group = SequenceGroup("g", [parent], SamplingParams(), 0.0)
    bm.allocate(group)
    parent.status = SequenceStatus.RUNNING
    parent.data.num_computed_tokens = 5
    child = parent.fork(2)
    bm.fork(parent, child)
    group.seqs.append(child)
    for seq, token in ((parent, 10), (child, 11)):
        seq.append_token(token, 0.0, None)
    assert bm.append_need(group) == 1
    copies = [bm.append_slots(s) for s in group.seqs]
    assert sum(c is not None for c in copies) == 1 and bm.get_num_free_device_blocks() == 8 - 3


def test_swap_in_counts_only_the_swapped_sequences():
    """A finished sequence's device blocks (ids of the other pool) do not inflate the need."""
    from encdec_engine.sampling_params import SamplingParams
    from encdec_engine.engine.sequence_group import Sequence, SequenceGroup
    from encdec_engine.sequence import SequenceStatus

    bm = BlockManager(4, 6, num_swap_blocks=6)
    running, done = Sequence(1, [5] * 6), Sequence(2, [6] * 6)
    group = SequenceGroup("g", [running, done], SamplingParams(n=2), 0.0)
    bm.allocate(group)  # 2 blocks each
    running.status, done.status = SequenceStatus.RUNNING, SequenceStatus.FINISHED_STOPPED
    running.data.num_computed_tokens = 6
    bm.swap_out(group)
    assert bm.can_swap_in(group).name == "OK"  # needs 2 blocks; 4 are free


def test_a_cross_table_is_one_run_of_blocks_even_in_a_fragmented_pool():
    """A cross table is read at every decode step: in place when its blocks are consecutive, gathered
    otherwise (3.4x slower measured for beam search over 10 minutes of VAD chunks, once a run without
    VAD had left the free list out of order)."""
    from encdec_engine.engine.block_manager import BlockAllocator

    pool = BlockAllocator(40, first_id=1)
    taken = [pool.allocate() for _ in range(40)]
    for block in taken[::-1][::2] + taken[::-1][1::2]:  # freed in an order that scatters the free list
        pool.free(block)
    assert list(pool._free)[:3] == [1, 3, 5]  # the most recently freed first
    run = pool.allocate_run(6)
    assert run == list(range(run[0], run[0] + 6))
    for block in run:
        pool.free(block)
    # A run holding cached content is taken only when no other run fits.
    pool.register(1, b"encoder output")
    assert pool.allocate_run(6) == list(range(2, 8))
    assert pool.lookup(b"encoder output") == 1
    # No run of that length left: the first free blocks.
    for block in range(9, 41, 2):
        pool._take(block)
    free_before = list(pool._free)
    assert pool.allocate_run(3) == free_before[:3]


def test_the_block_manager_gives_cross_tables_consecutive_blocks_after_churn():
    bm = BlockManager(BS, num_device_blocks=40)
    groups = [group(str(i), dec_len=3, enc_len=9, seq_id=i) for i in range(10)]  # 4 blocks each: the whole pool
    for g in groups:
        bm.allocate(g)
    for g in groups[::2] + groups[1::2]:  # finished out of order
        bm.free(g.seqs[0])
        bm.free_cross(g)
    for enc_len in (8 * BS, 2 * BS):  # long and short contexts alike (a lone sequence reads either in place)
        g = group(f"new{enc_len}", dec_len=3, enc_len=enc_len, seq_id=99 + enc_len)
        bm.allocate(g)
        table = bm.get_cross_block_table(g)
        assert table == list(range(table[0], table[0] + len(table)))


def test_a_self_table_grows_into_the_blocks_after_it():
    """A sequence's new blocks follow its last one while those are free and hold no cached content,
    so that a lone sequence's self context stays one run (read in place); else the first free block."""
    bm = BlockManager(BS, num_device_blocks=40)
    g = group("a", dec_len=3, enc_len=3 * BS, seq_id=1)
    bm.allocate(g)
    seq = g.seqs[0]
    cross, table = bm.get_cross_block_table(g), bm.get_block_table(seq)
    assert table == [cross[-1] + 1]  # the cross run first, the self table after it
    for _ in range(2 * BS):
        seq.append_token(7, 0.0, None)
        bm.append_slots(seq)
        seq.data.num_computed_tokens = len(seq) - 1
    assert bm.get_block_table(seq) == list(range(table[0], table[0] + 3))
    # The block after the last one is taken by another request: the first free block instead.
    other = group("b", dec_len=1, enc_len=BS, seq_id=2)
    bm.allocate(other)
    oldest = next(iter(bm.device._free))
    for _ in range(BS):
        seq.append_token(7, 0.0, None)
        bm.append_slots(seq)
        seq.data.num_computed_tokens = len(seq) - 1
    assert bm.get_block_table(seq)[-1] == oldest
    # A free block that holds cached content is not taken out of turn.
    pool = BlockAllocator(8)
    assert [pool.allocate() for _ in range(4)] == [0, 1, 2, 3]
    pool.register(1, b"cached")
    pool.free(1)
    pool.free(2)
    pool.free(3)  # free list: 3, 2 (most recently freed first), 4..7 (never used), 1 (cached)
    assert pool.allocate(after=0) == 3  # 1 holds cached content: the first free instead
    assert pool.allocate(after=3) == 4  # free, nothing cached: taken out of turn
    assert [pool.allocate() for _ in range(5)] == [2, 5, 6, 7, 1]
    assert pool.lookup(b"cached") is None  # handed out: its content goes


def test_requests_one_after_another_reuse_the_same_blocks():
    """A one-file job (or a quiet server) runs one request after another: each takes the blocks the last
    one freed, still mapped and warm, instead of walking through the pool (every never-used block costs
    page faults at its first write, and a walked pool holds its whole size in memory: a 4 GB pool grew
    the process by 3 GB over five batches of 8 Whisper windows). Tables stay one run each."""
    bm = BlockManager(BS, num_device_blocks=200)
    first = None
    for i in range(6):
        g = group(f"r{i}", dec_len=5, enc_len=10 * BS, seq_id=i)
        bm.allocate(g)
        cross, own = bm.get_cross_block_table(g), bm.get_block_table(g.seqs[0])
        assert cross == list(range(cross[0], cross[0] + 10)) and own == list(range(own[0], own[0] + 2))
        first = first or (cross, own)
        assert (cross, own) == first
        bm.free_group(g)
    assert bm.get_num_free_device_blocks() == 200
