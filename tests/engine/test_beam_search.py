"""Beam search and forking: parity with HF generate(num_beams=...), shared blocks, summarize."""

import pytest
import torch
from helpers import assert_preemption_keeps_outputs, mixed_prompts
from transformers import BartForConditionalGeneration

from encdec_engine import SamplingParams


def hf_beams(model, encoder_ids, decoder_ids, max_new, num_beams, n, **kw) -> list[list[int]]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([encoder_ids]), decoder_input_ids=torch.tensor([decoder_ids]),
                             max_new_tokens=max_new, num_beams=num_beams, num_return_sequences=n, do_sample=False,
                             forced_eos_token_id=None, forced_bos_token_id=None, min_length=0, **kw)
    rows = []
    for row in out[:, len(decoder_ids):].tolist():
        rows.append(row[: row.index(2) + 1] if 2 in row else row)  # cut HF's padding after EOS
    return rows


@pytest.mark.parametrize("config", ["small", "odd_heads", "untied"])
@pytest.mark.parametrize("kw", [dict(length_penalty=1.0, early_stopping=False),
                                dict(length_penalty=2.0, early_stopping=True, no_repeat_ngram_size=3),
                                dict(length_penalty=0.5, early_stopping="never")])
def test_beam_search_matches_hf(config, kw, bart_paths, make_llm):
    llm = make_llm(bart_paths[config], num_kv_blocks=600)
    model = BartForConditionalGeneration.from_pretrained(bart_paths[config]).eval()
    prompts = mixed_prompts(llm.get_tokenizer(), n=6, seed=31)
    params = SamplingParams(num_beams=4, n=3, max_tokens=12, temperature=0.0, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for o in outs:
        ref = hf_beams(model, o.encoder_prompt_token_ids, o.prompt_token_ids, 12, 4, 3, **kw)
        assert [c.token_ids for c in o.outputs] == ref


def test_beam_search_finishes_on_eos_with_min_tokens(bart_path, make_llm):
    llm = make_llm(bart_path, num_kv_blocks=600)
    model = BartForConditionalGeneration.from_pretrained(bart_path).eval()
    prompts = mixed_prompts(llm.get_tokenizer(), n=5, seed=32)
    outs = llm.generate(prompts, SamplingParams(num_beams=3, n=3, max_tokens=30, min_tokens=4), use_tqdm=False)
    for o in outs:
        ref = hf_beams(model, o.encoder_prompt_token_ids, o.prompt_token_ids, 30, 3, 3, min_new_tokens=4)
        assert [c.token_ids for c in o.outputs] == ref


@pytest.mark.parametrize("lengths", [dict(min_length=12, max_length=30), dict(min_new_tokens=9, max_new_tokens=14), {}],
                         ids=["length", "new_tokens", "hf_default"])
def test_summarize_matches_hf_with_a_bart_large_cnn_style_config(lengths, bart_path, make_llm):
    llm = make_llm(bart_path, num_kv_blocks=600)
    gc = llm.engine.generation_config
    saved = gc.to_dict()
    cnn = dict(num_beams=4, length_penalty=2.0, no_repeat_ngram_size=3, early_stopping=True,
               forced_bos_token_id=0, forced_eos_token_id=2, **lengths)
    for key, value in cnn.items():
        setattr(gc, key, value)
    try:
        docs = [" ".join(p if isinstance(p, str) else "" for p in mixed_prompts(llm.get_tokenizer(), 6, s)[:1])
                for s in range(4)]
        docs = [d for d in docs if d] or ["The rain in spain falls mainly on the plain."]
        summaries = llm.summarize(docs)
        model = BartForConditionalGeneration.from_pretrained(bart_path).eval()
        tok = llm.get_tokenizer()
        for doc, summary in zip(docs, summaries):
            with torch.no_grad():
                ref = model.generate(**tok(doc, return_tensors="pt"), **cnn)
            assert summary == tok.decode(ref[0], skip_special_tokens=True).strip()
    finally:
        for key in cnn:
            setattr(gc, key, saved.get(key))


def test_forked_sequences_share_blocks(bart_path, make_llm):
    llm = make_llm(bart_path, num_kv_blocks=600, block_size=4)
    engine = llm.engine
    engine.add_request("fork", {"prompt_token_ids": [0] + list(range(10, 40)) + [2]},
                       SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True))
    free = engine.num_free_blocks()[0]
    engine.step()  # prefill: one sequence, then 3 forks that share its blocks
    group = engine.groups["fork"]
    tables = [engine.block_manager.get_block_table(s) for s in group.seqs]
    assert len(group.seqs) == 4 and all(t == tables[0] for t in tables)
    cross = len(engine.block_manager.get_cross_block_table(group))
    assert free - engine.num_free_blocks()[0] == cross + 1  # 8 cross blocks + 1 self block, shared by all 4
    engine.step()  # each sequence writes its 2nd token into the shared block: copy-on-write
    tables = [engine.block_manager.get_block_table(s) for s in group.seqs]
    assert len({t[0] for t in tables}) == 4
    while engine.has_unfinished_requests():
        engine.step()


def test_seeded_n4_sampling_is_reproducible(bart_path, make_llm):
    llm = make_llm(bart_path, num_kv_blocks=600)
    params = SamplingParams(n=4, temperature=8.0, seed=11, max_tokens=10)
    a = llm.generate(["The rain in spain"], params, use_tqdm=False)[0]
    b = llm.generate(["The rain in spain"], params, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1


@pytest.mark.parametrize("params,blocks", [
    (SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=24, ignore_eos=True), 40),
    (SamplingParams(num_beams=3, n=2, max_tokens=16, temperature=0.0, ignore_eos=True), 28),  # beams share more
], ids=["n2", "beams3"])
@pytest.mark.parametrize("swap", [0.0, 0.001], ids=["recompute", "swap"])
def test_forked_groups_keep_their_outputs_when_preempted(params, blocks, swap, bart_path, make_llm):
    prompts = ["The rain in spain falls mainly", "On the plain it rains", "Which is plain to see"]
    assert_preemption_keeps_outputs(make_llm, bart_path, prompts, params, num_kv_blocks=blocks, block_size=4,
                                    swap_space_gb=swap)


@pytest.mark.parametrize("params", [SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=40, ignore_eos=True),
                                    SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True),
                                    SamplingParams(num_beams=3, max_tokens=40, temperature=0.0, ignore_eos=True)],
                         ids=["n2", "greedy", "beams3"])
@pytest.mark.parametrize("swap", [0.0, 0.001], ids=["recompute", "swap"])
def test_a_request_that_outgrows_the_pool_ends_as_length_alone(params, swap, bart_path, make_llm):
    """It keeps what it generated (a prefix of the roomy run's output) and the batch goes on."""
    prompts = ["The rain in spain falls", "On the plain"]
    short = SamplingParams(max_tokens=3, temperature=0.0)
    roomy = make_llm(bart_path, num_kv_blocks=400).generate(prompts, [params, short], use_tqdm=False)
    small = make_llm(bart_path, num_kv_blocks=20, block_size=4, swap_space_gb=swap)
    outs = small.generate(prompts, [params, short], use_tqdm=False)
    assert outs[1].outputs[0].token_ids == roomy[1].outputs[0].token_ids
    capped = outs[0].outputs
    assert capped and all(c.finish_reason == "length" for c in capped)
    assert all(0 < len(c.token_ids) < params.max_tokens for c in capped)
    if not params.use_beam_search:
        for c, r in zip(capped, roomy[0].outputs):
            assert c.token_ids == r.token_ids[: len(c.token_ids)]
    assert small.engine.num_free_blocks() == small.engine.num_total_blocks()


def test_a_beam_request_keeps_its_id_until_it_finishes(bart_path, make_llm):
    engine = make_llm(bart_path, num_kv_blocks=600).engine
    engine.add_request("x", "The rain in spain", SamplingParams(num_beams=3, max_tokens=10))
    engine.step()
    engine.step()
    assert "x" in engine.groups
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", "On the plain", SamplingParams(temperature=0.0))
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[-1].finished and "x" not in engine.groups


def test_stop_token_ids_end_beams_as_extra_eos_ids_do_in_hf(bart_path, make_llm):
    llm = make_llm(bart_path, num_kv_blocks=600)
    model = BartForConditionalGeneration.from_pretrained(bart_path).eval()
    prompts = mixed_prompts(llm.get_tokenizer(), n=4, seed=33)
    base = llm.generate(prompts, SamplingParams(num_beams=3, max_tokens=12, temperature=0.0), use_tqdm=False)
    stop = base[0].outputs[0].token_ids[3]
    outs = llm.generate(prompts, SamplingParams(num_beams=3, n=2, max_tokens=12, temperature=0.0, stop_token_ids=[stop]),
                        use_tqdm=False)
    assert any(c.token_ids[-1] == stop and c.finish_reason == "stop" for o in outs for c in o.outputs)
    for o in outs:
        ref = hf_beams(model, o.encoder_prompt_token_ids, o.prompt_token_ids, 12, 3, 2, eos_token_id=[2, stop])
        cut = [r[: next((i + 1 for i, t in enumerate(r) if t == stop), len(r))] for r in ref]  # HF pads after it
        assert [c.token_ids for c in o.outputs] == cut


def _outputs(llm, prompts, params) -> list[list[list[int]]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.num_free_blocks() == llm.engine.num_total_blocks()
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_requests_sharing_a_cached_block_swap_out_in_one_step(bart_path, make_llm):
    """Each swaps out its own copy of the shared block (a dict keyed by device block lost one)."""
    enc = {"prompt_token_ids": [0, 325, 565, 2]}  # one encoder input: one cached cross block for all three
    prompts = [{"encoder_prompt": enc, "decoder_prompt": {"prompt_token_ids": dec}} for dec in
               ([2, 0, 396, 345, 307, 149, 6, 299, 524], [2, 0, 355, 586, 139, 430],
                [2, 0, 355, 586, 139, 430, 439, 186, 381, 172, 286, 37])]
    params = [SamplingParams(n=4, best_of=6, temperature=3.0, seed=347, max_tokens=16),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)]
    roomy = _outputs(make_llm(bart_path, num_kv_blocks=600, block_size=4), prompts, params)
    tight = make_llm(bart_path, num_kv_blocks=10, block_size=4, swap_space_gb=0.001, reserve_decode_growth=False)
    before = tight.engine.scheduler.num_preemptions
    assert _outputs(tight, prompts, params)[1:] == roomy[1:]  # the first outgrows this pool: it ends early
    assert tight.engine.scheduler.num_preemptions > before


@pytest.mark.parametrize("config", [dict(num_kv_blocks=20, enable_prefix_caching=False),
                                    dict(num_kv_blocks=20, enable_prefix_caching=True),
                                    dict(num_kv_blocks=22, max_num_batched_tokens=64)],
                         ids=["caching_off", "caching_on", "small_prefill_budget"])
def test_a_recomputed_fork_group_shares_its_prefix_and_is_not_cut_short(config, bart_path, make_llm):
    """Its forks are prefilled together, sharing full prompt blocks, as they did before preemption."""
    a = ({"encoder_prompt": {"prompt_token_ids": [0, 325, 565, 2]},
          "decoder_prompt": {"prompt_token_ids": [2, 0] + list(range(100, 110))}},
         SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True))
    b = ({"prompt_token_ids": [0, 400, 401, 402, 2]}, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    llm = make_llm(bart_path, block_size=4, reserve_decode_growth=False, **config)
    alone = _outputs(llm, [a[0]], [a[1]])[0]
    before = llm.engine.scheduler.num_preemptions
    together = _outputs(llm, [b[0], a[0]], [b[1], a[1]])  # b is older: a is preempted
    assert llm.engine.scheduler.num_preemptions > before
    assert together[1] == alone and all(len(t) == 16 for t in alone)


def test_fanout_over_max_num_seqs_is_refused_not_hung(bart_path, make_llm):
    llm = make_llm(bart_path, num_kv_blocks=200, max_num_seqs=2)
    for params in (SamplingParams(n=3, temperature=1.0), SamplingParams(n=1, best_of=3, temperature=1.0),
                   SamplingParams(num_beams=3, temperature=0.0)):
        with pytest.raises(ValueError, match="runs 3 sequences .* max_num_seqs is 2"):
            llm.generate(["The rain"], params, use_tqdm=False)
