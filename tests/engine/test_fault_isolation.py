"""Fault injection: one request's fault, or one failed step, costs only what it touched.

Each test runs a workload with and without an injected fault: a logits processor raising for 1 of 8
requests, a forward raising once, a tokenizer that cannot convert one id, a step failing after it
allocated (and registered) prefix-cache blocks. The requests the fault did not touch finish with the
same tokens as without it, the prefix cache answers correctly afterwards (no block is found before
the step that writes it succeeds), and every KV block is free at the end (conftest checks that after
every test). Faults injected: 1 raising processor, 5 raising forwards (a prefill, a decode step, two
prefills that had registered cache blocks, one under the async engine), 1 unconvertible token and 1
rolled-back step in the block manager.
"""

from __future__ import annotations

import asyncio

import pytest
from helpers import BrokenOnOneToken, MissingOneToken, fresh_prompts, tokens

from encdec_engine import SamplingParams
from encdec_engine.engine.async_engine import AsyncLLMEngine, RequestFailedError
from encdec_engine.engine.block_manager import BlockManager
from encdec_engine.sequence import EncoderSequence, SequenceStatus
from encdec_engine.engine.sequence_group import Sequence, SequenceGroup

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(bart_path, make_llm):
    return make_llm(bart_path, num_kv_blocks=300, block_size=4)


@pytest.fixture(scope="module")
def reference(bart_path, make_llm):
    """Caching off, never faulted: what every request should decode to."""
    ref = make_llm(bart_path, num_kv_blocks=300, block_size=4, enable_prefix_caching=False)
    return lambda prompts: tokens(ref.generate(prompts, GREEDY, use_tqdm=False))


def fail_forward_once(engine, monkeypatch, when=lambda call, inp: True) -> list[int]:
    """The runner's next forward for which `when(call index, model input)` holds raises; returns the calls."""
    forward, calls = engine.runner._forward, []

    def failing(inp):
        calls.append(len(calls))
        if when(calls[-1], inp) and "raised" not in calls:
            calls.append("raised")
            raise RuntimeError("injected kernel failure")
        return forward(inp)

    monkeypatch.setattr(engine.runner, "_forward", failing)
    return calls


def run(engine, adds: dict[int, list[tuple[str, dict, SamplingParams]]]) -> dict:
    """Step the engine to the end, adding requests at the given steps; the final output per request."""
    finished, step = {}, 0
    while step <= max(adds) or engine.has_unfinished_requests():
        for rid, prompt, params in adds.get(step, ()):
            engine.add_request(rid, prompt, params)
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
        step += 1
    return finished


def test_a_raising_logits_processor_fails_its_request_alone(llm, reference):
    prompts = fresh_prompts(1)
    expected = reference(prompts)

    def buggy(output_token_ids, logits) -> None:
        if len(output_token_ids) == 3:
            raise KeyError("processor bug")

    params = [GREEDY] * 8
    params[5] = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logits_processors=[buggy])
    outs = llm.generate(prompts, params, use_tqdm=False)
    bad = outs[5]
    assert bad.outputs[0].finish_reason == "error" and "KeyError" in bad.error and "processor bug" in bad.error
    assert bad.outputs[0].token_ids == expected[5][:3] and bad.outputs[0].error == bad.error
    assert [t for i, t in enumerate(tokens(outs)) if i != 5] == [t for i, t in enumerate(expected) if i != 5]
    assert all(o.error is None for i, o in enumerate(outs) if i != 5)


def test_a_forward_raising_once_fails_only_its_batch(llm, reference, monkeypatch):
    engine = llm.engine
    prompts = fresh_prompts(2)
    expected = reference(prompts)
    fail_forward_once(engine, monkeypatch, when=lambda call, inp: call == 2)  # the prefill of the second four
    adds = {0: [(f"a{i}", p, GREEDY) for i, p in enumerate(prompts[:4])],
            2: [(f"b{i}", p, GREEDY) for i, p in enumerate(prompts[4:])]}
    outs = run(engine, adds)
    assert [outs[f"a{i}"].outputs[0].token_ids for i in range(4)] == expected[:4]
    for i in range(4):
        assert outs[f"b{i}"].outputs[0].finish_reason == "error" and "injected kernel failure" in outs[f"b{i}"].error
    assert engine.stats["failed_steps"] >= 1
    # The engine goes on, and the failed prompts (their cross and self blocks were never written) decode right.
    monkeypatch.undo()
    assert tokens(llm.generate(prompts[4:], GREEDY, use_tqdm=False)) == expected[4:]


def test_a_failed_decode_step_fails_its_batch_and_the_rest_goes_on(llm, reference, monkeypatch):
    engine = llm.engine
    prompts = fresh_prompts(3)
    expected = reference(prompts)
    fail_forward_once(engine, monkeypatch, when=lambda call, inp: call == 3)  # a decode step of the first four
    outs = run(engine, {0: [(f"a{i}", p, GREEDY) for i, p in enumerate(prompts[:4])],
                        5: [(f"b{i}", p, GREEDY) for i, p in enumerate(prompts[4:])]})
    assert all(outs[f"a{i}"].outputs[0].finish_reason == "error" for i in range(4))
    assert [outs[f"b{i}"].outputs[0].token_ids for i in range(4)] == expected[4:]


@pytest.mark.parametrize("decoder_len", [2, 14])
def test_a_failed_prefill_does_not_poison_the_prefix_cache(llm, reference, monkeypatch, decoder_len):
    """The issue's case: a prefill raises after allocating (and registering) cross blocks, and with a long
    decoder prompt full self blocks; the same prompts again must run the encoder and decode right, not
    read the never-written blocks (old main: [551, 501, 501, ...] instead of [316, 316, 316, ...])."""
    engine = llm.engine
    prompts = fresh_prompts(10 + decoder_len, n=3, decoder_len=decoder_len)
    expected = reference(prompts)
    fail_forward_once(engine, monkeypatch)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["error"] * 3 and all(o.outputs[0].token_ids == [] for o in outs)
    monkeypatch.undo()
    runs = engine.stats["encoder_runs"]
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert engine.stats["encoder_runs"] - runs == 3  # no cross-cache hit on the failed step's blocks
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected  # now cached, still right
    assert engine.stats["encoder_runs"] - runs == 3


def test_a_fault_in_one_requests_output_processing_fails_it_alone(llm, reference, monkeypatch):
    """Detokenizing one request's token raises (the issue's case was a tokenizer without timestamp tokens,
    which the detokenizer now handles): that request ends with the error, every other one decodes on."""
    prompts = fresh_prompts(4)
    expected = reference(prompts)
    others = {t for i, ts in enumerate(expected) if i != 0 for t in ts}
    bad_id = next(t for t in expected[0] if t not in others)
    detok = llm.engine.output_processor.detokenizer

    monkeypatch.setattr(detok, "tokenizer", BrokenOnOneToken(detok.tokenizer, bad_id))
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "TypeError" in outs[0].error
    assert tokens(outs)[1:] == expected[1:] and all(o.error is None for o in outs[1:])


def test_a_token_the_tokenizer_has_no_string_for_adds_no_text(llm, reference, monkeypatch):
    """A tokenizer returning None for one id (the issue: one without timestamp tokens) used to make
    Detokenizer.step raise and every request in flight fail; now that token adds no text, as in vLLM,
    and every request decodes its reference tokens."""
    prompts = fresh_prompts(6)
    expected = reference(prompts)
    bad_id = expected[0][0]
    detok = llm.engine.output_processor.detokenizer
    monkeypatch.setattr(detok, "tokenizer", MissingOneToken(detok.tokenizer, bad_id))
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert tokens(outs) == expected and all(o.error is None for o in outs)


def test_async_callers_of_a_failed_batch_get_the_error_and_the_engine_serves_on(bart_path, make_llm, reference,
                                                                                  monkeypatch):
    engine = make_llm(bart_path, num_kv_blocks=300, block_size=4).engine
    prompts = fresh_prompts(5, n=4)
    expected = reference(prompts)

    async def main():
        async_engine = AsyncLLMEngine(engine)

        async def one(prompt, rid):
            return [out async for out in async_engine.generate(prompt, GREEDY, rid)][-1]

        stream = async_engine.generate(prompts[0], GREEDY, "first")
        await anext(stream)  # the first request is decoding
        # The next prefill (the second request alone) fails; the first request decodes on.
        is_prefill = lambda call, inp: inp.encoder_inputs is not None  # noqa: E731
        await async_engine.run_in_engine(lambda e: fail_forward_once(e, monkeypatch, when=is_prefill))
        with pytest.raises(RequestFailedError, match="injected kernel failure"):
            await one(prompts[1], "second")
        assert [out async for out in stream][-1].outputs[0].token_ids == expected[0]
        await async_engine.run_in_engine(lambda e: monkeypatch.undo())
        later = await asyncio.gather(one(prompts[2], "third"), one(prompts[3], "fourth"))
        assert [o.outputs[0].token_ids for o in later] == expected[2:]
        assert async_engine.is_running and async_engine.snapshot.num_step_errors == 0
        await async_engine.shutdown()

    asyncio.run(main())


# -- the block manager: nothing outlives its request or its step -------------------------------
def _group(rid: str, seq_ids: list[int], dec: list[int], enc_key: bytes | None, enc_len: int = 8) -> SequenceGroup:
    enc = EncoderSequence(num_positions=enc_len, cache_key=enc_key)
    return SequenceGroup(rid, [Sequence(i, dec) for i in seq_ids], SamplingParams(), 0.0, enc)


def test_with_caching_off_nothing_is_shared_across_requests():
    """Recomputed forks share their prefix within the request; those keys never reach the pool's cache,
    so a later request (even one reusing the request id) cannot find the freed blocks."""
    bm = BlockManager(4, num_device_blocks=40, enable_caching=False)
    a = _group("same-id", [0, 1], [2, 0] + list(range(10, 20)), b"a")
    bm.allocate(a)
    assert bm.get_block_table(a.seqs[0])[:2] == bm.get_block_table(a.seqs[1])[:2]  # shared within the request
    bm.free_group(a)
    assert not bm.device._cached  # nothing findable once the request is gone
    b = _group("same-id", [2, 3], [2, 0] + list(range(10, 20)), b"b")
    bm.allocate(b)
    assert b.seqs[0].data.num_computed_tokens == 0 and not b.encoder_cached  # a's blocks were not found
    bm.free_group(b)
    assert bm.get_num_free_device_blocks() == 40


def test_groups_with_the_same_request_id_never_share_a_cross_table():
    """Cross tables are keyed by a key unique for the process's life, not by the caller's request id."""
    bm = BlockManager(4, num_device_blocks=40, enable_caching=False)
    a, b = _group("rid", [0], [2, 0], None), _group("rid", [1], [2, 0], None)
    assert a.key != b.key
    bm.allocate(a)
    bm.allocate(b)
    assert set(bm.get_cross_block_table(a)).isdisjoint(bm.get_cross_block_table(b))
    bm.free_group(a)
    bm.free_group(b)
    assert bm.get_num_free_device_blocks() == 40


def test_a_rolled_back_step_unregisters_what_it_allocated():
    bm = BlockManager(4, num_device_blocks=40, enable_caching=True)
    a = _group("a", [0], [2, 0] + list(range(10, 20)), b"doc")
    bm.allocate(a)
    for seq in a.seqs:
        seq.status = SequenceStatus.RUNNING
    bm.rollback_step()  # the step that was to write a's blocks failed
    bm.free_group(a)
    b = _group("b", [1], [2, 0] + list(range(10, 20)), b"doc")
    bm.allocate(b)
    assert not b.encoder_cached and b.seqs[0].data.num_computed_tokens == 0
    bm.commit_step()  # b's step succeeded: its blocks are found from now on
    bm.free_group(b)
    c = _group("c", [2], [2, 0] + list(range(10, 20)), b"doc")
    bm.allocate(c)
    assert c.encoder_cached and c.seqs[0].data.num_computed_tokens == 8
    bm.free_group(c)
    assert bm.get_num_free_device_blocks() == 40
