"""Whatever ends a step early, the prefix cache stays right and every block comes back.

A fault is injected once at each point of a step (schedule, the block allocation inside it, the
swap-in, swap-out and copy of KV blocks, the forward, applying the results), as an ordinary error,
as KeyboardInterrupt (Ctrl-C during `LLM.generate`) and as SystemExit. Afterwards the same prompts
decode to the reference tokens of an engine that was never faulted, the prefix cache serves them
again correctly, and free blocks equal total blocks (conftest checks that after every test, too).
Old main: an interrupt in the forward left the step's hashes pending, the next step committed them,
and every later run of the prompt read never-written blocks ([241, 9, 241, 477, ...]).
"""

from __future__ import annotations

import zlib

import pytest
from helpers import fresh_prompts, tokens

from encdec_engine import SamplingParams

# Two samples per prompt fork at the first token (a copy-on-write of the shared partial block); a pool
# of 40 blocks with swap space, admitting without room held back for growth, preempts by swapping out
# and back in.
PARAMS = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=16, ignore_eos=True)
ENGINE = dict(num_kv_blocks=40, block_size=4, swap_space_gb=0.01, reserve_decode_growth=False)


@pytest.fixture(scope="module")
def llm(bart_path, make_llm):
    return make_llm(bart_path, **ENGINE)


@pytest.fixture(scope="module")
def reference(bart_path, make_llm):
    ref = make_llm(bart_path, **ENGINE, enable_prefix_caching=False)
    return lambda prompts: samples(ref.generate(prompts, PARAMS, use_tqdm=False))


def samples(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def _points(engine) -> dict:
    """Where to inject: (object, attribute, fire when, raise after the real call)."""
    nonempty = lambda pairs, *a: bool(pairs)  # noqa: E731
    return {
        "schedule": (engine.scheduler, "schedule", lambda *a: True, False),
        "allocate": (engine.block_manager, "allocate", lambda *a: True, True),  # after its hashes registered
        "swap_in": (engine.cache_engine, "swap_in", nonempty, False),
        "swap_out": (engine.cache_engine, "swap_out", nonempty, False),
        "copy": (engine.cache_engine, "copy", nonempty, False),
        "forward": (engine.runner, "_forward", lambda *a: True, False),
        "apply": (engine.output_processor, "apply", lambda *a: True, False),
    }


def inject_once(monkeypatch, target, name: str, error: type[BaseException], when, after: bool) -> list[bool]:
    """`target.name` raises `error` once, at its first call for which `when(*args)` holds."""
    real, fired = getattr(target, name), []

    def faulty(*args, **kwargs):
        if fired or not when(*args):
            return real(*args, **kwargs)
        fired.append(True)
        result = real(*args, **kwargs) if after else None
        raise error(f"injected at {name}")
        return result

    monkeypatch.setattr(target, name, faulty)
    return fired


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit, RuntimeError])
@pytest.mark.parametrize("point", ["schedule", "allocate", "swap_in", "swap_out", "copy", "forward", "apply"])
def test_an_interrupted_step_never_poisons_the_cache_nor_leaks(llm, reference, monkeypatch, point, error):
    engine = llm.engine
    prompts = fresh_prompts(zlib.crc32(f"{point}/{error.__name__}".encode()), n=6, decoder_len=1)
    expected = reference(prompts)
    target, name, when, after = _points(engine)[point]
    fired = inject_once(monkeypatch, target, name, error, when, after)
    try:
        outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    except BaseException as e:  # an interrupt (or a failure outside any one request) reaches the caller
        assert isinstance(e, error)
    else:  # an ordinary error fails the requests it touched, and only those
        assert error is RuntimeError
        for out, want in zip(outs, expected):
            assert out.error is not None or samples([out]) == [want]
    assert fired, f"the workload never reached {point}"
    monkeypatch.undo()
    assert engine.num_free_blocks() == engine.num_total_blocks()
    assert samples(llm.generate(prompts, PARAMS, use_tqdm=False)) == expected
    assert samples(llm.generate(prompts, PARAMS, use_tqdm=False)) == expected  # served from the cache


def test_ctrl_c_in_the_forward_then_the_same_document_decodes_right(bart_path, make_llm):
    """The issue's case: greedy BART, Ctrl-C inside the prefill's forward, the same document again."""
    llm = make_llm(bart_path, num_kv_blocks=300, block_size=4)
    ref = make_llm(bart_path, num_kv_blocks=300, block_size=4, enable_prefix_caching=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = fresh_prompts(4242, n=2, decoder_len=6)
    expected = tokens(ref.generate(prompts, greedy, use_tqdm=False))
    with pytest.MonkeyPatch.context() as mp:
        inject_once(mp, llm.engine.runner, "_forward", KeyboardInterrupt, lambda *a: True, False)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, greedy, use_tqdm=False)
    for _ in range(2):
        assert tokens(llm.generate(prompts, greedy, use_tqdm=False)) == expected


def test_an_interrupted_step_s_requests_come_back_failed_at_the_next_step(bart_path, make_llm):
    """Stepping the engine by hand: the requests the interrupted step held end with "error" (their KV
    is incomplete) and are handed back by the next step; the engine then serves on."""
    llm = make_llm(bart_path, num_kv_blocks=300, block_size=4)
    engine = llm.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = fresh_prompts(4343, n=2)
    for i, p in enumerate(prompts):
        engine.add_request(f"hand-{i}", p, greedy)
    with pytest.MonkeyPatch.context() as mp:
        inject_once(mp, engine.runner, "_forward", KeyboardInterrupt, lambda *a: True, False)
        with pytest.raises(KeyboardInterrupt):
            engine.step()
    assert engine.has_unfinished_requests()
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == ["hand-0", "hand-1"]
    assert all(o.finished and o.error and "interrupted" in o.error for o in outs)
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks() == engine.num_total_blocks()
