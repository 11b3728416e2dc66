"""Encoder-output reuse: a cached encoder input skips the encoder and shares cross blocks;
decoder prefixes are reused per encoder input; outputs equal caching off."""

import pytest
from helpers import mixed_prompts

from encdec_engine import SamplingParams

DOC = {"prompt_token_ids": [0] + list(range(40, 100)) + [2]}


def run(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("block_size", [4, 16])
def test_same_document_many_decoder_prompts_runs_the_encoder_once(bart_path, make_llm, block_size):
    on = make_llm(bart_path, num_kv_blocks=500, block_size=block_size)
    off = make_llm(bart_path, num_kv_blocks=500, block_size=block_size, enable_prefix_caching=False)
    prompts = [{"encoder_prompt": DOC, "decoder_prompt": {"prompt_token_ids": [2, 0, 40 + i, 50 + i]}}
               for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=10)
    runs, hits = on.engine.stats["encoder_runs"], on.engine.block_manager.cache_stats["cross_hits"]
    assert run(on, prompts, params) == run(off, prompts, params)
    assert on.engine.stats["encoder_runs"] - runs <= 1  # 0 if an earlier test cached this document
    assert on.engine.block_manager.cache_stats["cross_hits"] - hits >= 7
    runs = on.engine.stats["encoder_runs"]
    assert run(on, prompts[:2], params) == run(off, prompts[:2], params)  # cached across calls too
    assert on.engine.stats["encoder_runs"] == runs


def test_decoder_prefix_blocks_are_reused(bart_path, make_llm):
    llm = make_llm(bart_path, num_kv_blocks=500, block_size=4)
    off = make_llm(bart_path, num_kv_blocks=500, block_size=4, enable_prefix_caching=False)
    prefix = [2, 0] + list(range(60, 74))
    prompts = [{"encoder_prompt": DOC, "decoder_prompt": {"prompt_token_ids": prefix + [80 + i]}} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=8)
    run(llm, prompts[:1], params)
    hits = llm.engine.block_manager.cache_stats["self_block_hits"]
    assert run(llm, prompts, params) == run(off, prompts, params)
    assert llm.engine.block_manager.cache_stats["self_block_hits"] - hits >= 4 * 4  # 16 cached prefix tokens each


def test_mixed_batches_equal_caching_off(bart_path, make_llm):
    on = make_llm(bart_path, num_kv_blocks=500, block_size=4)
    off = make_llm(bart_path, num_kv_blocks=500, block_size=4, enable_prefix_caching=False)
    prompts = mixed_prompts(on.get_tokenizer(), n=12, seed=41)
    prompts = prompts + prompts[:6]  # repeats: cache hits inside one batch and across steps
    params = SamplingParams(temperature=0, max_tokens=12)
    assert run(on, prompts, params) == run(off, prompts, params)
    beams = SamplingParams(num_beams=3, n=2, max_tokens=8)
    assert [[c.token_ids for c in o.outputs] for o in on.generate(prompts[:6], beams, use_tqdm=False)] == \
        [[c.token_ids for c in o.outputs] for o in off.generate(prompts[:6], beams, use_tqdm=False)]


def test_caching_under_memory_pressure(bart_path, make_llm):
    tight = make_llm(bart_path, num_kv_blocks=40, block_size=4)
    roomy = make_llm(bart_path, num_kv_blocks=500, block_size=4, enable_prefix_caching=False)
    prompts = mixed_prompts(tight.get_tokenizer(), n=10, seed=42) * 2
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    assert run(tight, prompts, params) == run(roomy, prompts, params)


def test_whisper_audio_reuse(make_llm):
    from pathlib import Path

    from encdec_engine.checkpoints.ct2.importer import default_model_path

    from encdec_engine.inputs.audio import load_audio

    llm = make_llm(default_model_path())
    # Quieter than the bundled clip, so no other test on this shared engine has cached it.
    samples = 0.5 * load_audio(Path(__file__).resolve().parents[2] / "prompts" / "audio" / "coffee.wav")
    audio = (samples, 16000)
    runs = llm.engine.stats["encoder_runs"]
    first = llm.transcribe([audio, audio, audio], timestamps=False, temperatures=(0.0,))
    assert len({r.text for r in first}) == 1
    assert llm.engine.stats["encoder_runs"] - runs == 1
