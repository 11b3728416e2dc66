"""Property-based: random arrivals, steps, forks, aborts, swaps and finishes against the
scheduler and block manager; the accounting invariants hold after every operation."""

from collections import Counter

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from encdec_engine.engine.block_manager import BlockManager
from encdec_engine.engine.scheduler import Scheduler, SchedulerConfig
from encdec_engine.sampling_params import SamplingParams
from encdec_engine.sequence import EncoderSequence, SequenceStatus
from encdec_engine.engine.sequence_group import Sequence, SequenceGroup

BS = 4
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 9), st.integers(0, 30), st.integers(0, 3)),
        st.tuples(st.just("step"), st.integers(0, 0), st.integers(0, 0), st.integers(0, 0)),
        st.tuples(st.just("fork"), st.integers(0, 50), st.integers(0, 0), st.integers(0, 0)),
        st.tuples(st.just("abort"), st.integers(0, 50), st.integers(0, 0), st.integers(0, 0)),
        st.tuples(st.just("finish"), st.integers(0, 50), st.integers(0, 0), st.integers(0, 0)),
    ),
    max_size=60,
)


def check_invariants(bm: BlockManager, s: Scheduler) -> None:
    # Reference counts equal the number of tables holding each block, per pool.
    device, swap = Counter(), Counter()
    for seq_id, table in bm.block_tables.items():
        (swap if seq_id in bm._swapped_seqs else device).update(table)
    for key, table in bm.cross_block_tables.items():
        (swap if key in bm._swapped_cross else device).update(table)
    for pool, counts in ((bm.device, device), (bm.swap, swap)):
        for block, n in counts.items():
            assert pool.ref_count(block) == n
        assert pool.num_free + len(counts) == pool.num_blocks
    assert 0 not in device  # the padding block is never handed out
    live = {g.key for q in (s.waiting, s.running, s.swapped) for g in q}
    assert set(bm.cross_block_tables) <= live
    for g in s.waiting:
        assert g.key not in bm.cross_block_tables
        assert all(seq.seq_id not in bm.block_tables for seq in g.seqs)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, caching=st.booleans(), swap_blocks=st.sampled_from([0, 24]))
def test_random_workloads_keep_the_accounting_exact(ops, caching, swap_blocks):
    bm = BlockManager(BS, num_device_blocks=24, num_swap_blocks=swap_blocks, enable_caching=caching)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), bm)
    groups: list[SequenceGroup] = []
    next_id = iter(range(10**6))
    for op, a, b, c in ops:
        if op == "add":
            # An encoder input's key fixes its length, as for real inputs.
            enc = EncoderSequence(num_positions=5 + 7 * c, cache_key=bytes([c])) if b else None
            g = SequenceGroup(f"r{len(groups)}", [Sequence(next(next_id), [2] * a)], SamplingParams(), 0.0, enc)
            groups.append(g)
            s.add(g)
        elif op == "step":
            meta, _ = s.schedule()
            for m in meta:
                for data in m.seq_data.values():
                    data.num_computed_tokens = len(data)
                    data.output_token_ids.append(7)
        elif op == "fork" and s.running:
            g = s.running[a % len(s.running)]
            parent = g.get_seqs(SequenceStatus.RUNNING)
            if parent and bm.get_num_free_device_blocks() > 0:
                child = parent[0].fork(next(next_id))
                bm.fork(parent[0], child)
                g.seqs.append(child)
        elif op == "abort" and groups:
            s.abort(groups[a % len(groups)].request_id)
        elif op == "finish" and s.running:
            for seq in s.running[a % len(s.running)].seqs:
                seq.status = SequenceStatus.FINISHED_STOPPED
            s.free_finished()
        check_invariants(bm, s)
    event(f"preempted: {s.num_preemptions > 0}")
    event(f"cross cache hits: {bm.cache_stats['cross_hits'] > 0}")
    for g in groups:
        s.abort(g.request_id)
    assert bm.get_num_free_device_blocks() == 24 and bm.get_num_free_swap_blocks() == swap_blocks
