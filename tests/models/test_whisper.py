"""Whisper end to end: token-exact parity with HF on tiny.en and random-init configs, long-form, errors."""


import jiwer
import numpy as np
import pytest
import torch
from helpers import AUDIO, ROOT, SHORT_CLIPS, TRANSCRIPTS, make_whisper, norm, record_requests
from transformers import WhisperForConditionalGeneration

from encdec_engine import SamplingParams
from encdec_engine.probes import no_speech_position
from encdec_engine.inputs.audio import load_audio
from encdec_engine.inputs.features import log_mel_spectrogram
from encdec_engine.checkpoints.ct2.importer import default_model_path

EXACT = dict(timestamps=False, temperatures=(0.0,))


def hf_tokens(model, features: torch.Tensor) -> list[list[int]]:
    """Full sequences from HF generate (prompt + generated + EOS), one clip at a time."""
    with torch.no_grad():
        return [model.generate(input_features=f[None], return_dict_in_generate=True).sequences[0].tolist()
                for f in features]


def test_transcribe_matches_hf_generate_on_every_clip(tiny_en, hf_tiny_en):
    results = tiny_en.transcribe([AUDIO / n for n in SHORT_CLIPS], **EXACT)
    features = log_mel_spectrogram([load_audio(AUDIO / n) for n in SHORT_CLIPS])
    refs = hf_tokens(hf_tiny_en, features)
    prompt = tiny_en.engine.input_processor.default_decoder_prompt
    for name, result, ref in zip(SHORT_CLIPS, results, refs):
        assert result.error is None
        assert len(result.segments) == 1
        assert prompt + result.segments[0].tokens + [50256] == ref, name
        assert jiwer.wer(norm(TRANSCRIPTS[name]), norm(result.text)) < 0.3, (name, result.text)


def test_batched_equals_one_at_a_time(tiny_en):
    files = [AUDIO / n for n in SHORT_CLIPS[:4]]
    batched = [r.segments[0].tokens for r in tiny_en.transcribe(files, **EXACT)]
    single = [tiny_en.transcribe([f], **EXACT)[0].segments[0].tokens for f in files]
    assert batched == single


def test_generate_with_audio_prompts_and_arrays(tiny_en):
    samples = load_audio(AUDIO / "coffee.wav")
    gc = tiny_en.engine.generation_config
    params = SamplingParams(temperature=0, max_tokens=100, suppress_tokens=gc.suppress_tokens,
                            begin_suppress_tokens=gc.begin_suppress_tokens)
    out = tiny_en.generate([{"prompt": "", "multi_modal_data": {"audio": (samples, 16000)}},
                            {"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": str(AUDIO / "coffee.wav")}},
                             "decoder_prompt": {"prompt_token_ids": [50257, 50362]}}], params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == out[1].outputs[0].token_ids
    assert norm(out[0].outputs[0].text) == norm(TRANSCRIPTS["coffee.wav"])
    assert tiny_en.transcribe((samples, 16000), **EXACT)[0].text == out[0].outputs[0].text


def test_timestamps_give_ordered_segments_within_the_audio(tiny_en):
    for result in tiny_en.transcribe([AUDIO / n for n in SHORT_CLIPS[:3]]):
        assert result.segments
        for seg in result.segments:
            assert 0.0 <= seg.start <= seg.end <= result.duration + 0.5
        assert [s.start for s in result.segments] == sorted(s.start for s in result.segments)


@pytest.mark.parametrize("beam_size", [1, 5])
def test_long_form_transcribes_to_the_end(beam_size, tiny_en, monkeypatch):
    added = record_requests(tiny_en.engine, monkeypatch)
    result = tiny_en.transcribe(AUDIO / "long_meeting.flac", beam_size=beam_size)[0]
    monkeypatch.undo()
    prompts = [prompt["decoder_prompt"]["prompt_token_ids"] for _, prompt, _ in added]
    assert result.duration > 60
    # openai-whisper's sample_len: a long-form window decodes at most half the decoder's 448 positions.
    assert {params.max_tokens for _, _, params in added} == {224}
    # As openai-whisper: a window is conditioned on the tokens of the segments kept so far, nothing else.
    kept, ends = [], {0}
    for seg in result.segments:
        kept += seg.tokens
        ends.add(len(kept))
    sot_prev, sot = 50360, 50257  # <|startofprev|>, <|startoftranscript|> of tiny.en
    conditioned = [p[1 : p.index(sot)] for p in prompts if p[0] == sot_prev]
    assert conditioned
    for prev in conditioned:
        assert any(kept[end - len(prev) : end] == prev for end in ends if end >= len(prev)), prev
    assert result.segments[-1].end > result.duration - 10
    wer = jiwer.wer(norm(TRANSCRIPTS["long_meeting.flac"]), norm(result.text))
    assert wer < 0.15, wer


def test_long_form_windows_see_only_their_audio(tiny_en, monkeypatch):
    """As openai-whisper and faster-whisper: a window's log-mel frames past its audio are zeros, not the
    log-mel of silence (the last window's no-speech probability then equals faster-whisper's)."""
    added = record_requests(tiny_en.engine, monkeypatch)
    result = tiny_en.transcribe(AUDIO / "long_meeting.flac", temperatures=(0.0,))[0]
    monkeypatch.undo()
    features = [prompt["encoder_prompt"]["multi_modal_data"]["input_features"] for _, prompt, _ in added]
    zero = (features[-1] == 0).all(dim=0).tolist()  # [frames] of the last window
    audio_frames = next(k for k in range(len(zero)) if all(zero[k:]))
    assert 0 < audio_frames < 3000 and not any(zero[:audio_frames])
    window_start = result.duration * 100 - audio_frames  # in mel frames: a segment of the window starts there
    assert any(abs(seg.start * 100 - window_start) <= 1 for seg in result.segments)


@pytest.mark.parametrize("bad,match", [("missing.wav", "missing.wav"), ("empty", "empty.wav"),
                                       ("corrupt", "corrupt.wav")])
def test_bad_files_are_named_and_others_still_transcribed(tiny_en, tmp_path, bad, match):
    path = tmp_path / f"{bad}.wav" if bad != "missing.wav" else tmp_path / "missing.wav"
    if bad == "empty":
        path.write_bytes(b"")
    elif bad == "corrupt":
        path.write_bytes(b"RIFF....WAVEfmt garbage" * 10)
    good, broken = tiny_en.transcribe([AUDIO / "coffee.wav", path], **EXACT)
    assert good.error is None and norm(good.text) == norm(TRANSCRIPTS["coffee.wav"])
    assert broken.error is not None and match in broken.error


def test_audio_prompt_errors(tiny_en):
    with pytest.raises(ValueError, match="needs multi_modal_data"):
        tiny_en.generate([{"prompt": ""}], use_tqdm=False)
    with pytest.raises(ValueError, match="one request holds at most 30 s"):
        tiny_en.generate([{"prompt": "", "multi_modal_data": {"audio": (torch.zeros(16000 * 31).numpy(), 16000)}}],
                         use_tqdm=False)
    with pytest.raises(ValueError, match="encoder prompt of an audio model is its audio"):
        tiny_en.generate(["some text"], use_tqdm=False)
    with pytest.raises(ValueError, match="English-only"):
        tiny_en.transcribe(AUDIO / "coffee.wav", language="de")


# -- random-init checkpoints ------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny-80", "odd-128"])  # models/configs/whisper.json
def test_random_init_whisper_matches_hf(tmp_path, make_llm, name):
    path = make_whisper(tmp_path / name, name)
    llm = make_llm(path)
    n_mels = llm.engine.model.num_mel_bins
    files = [AUDIO / n for n in SHORT_CLIPS[:5]]
    features = log_mel_spectrogram([load_audio(f) for f in files], n_mels=n_mels)
    gc = llm.engine.generation_config
    params = SamplingParams(temperature=0, max_tokens=40, suppress_tokens=gc.suppress_tokens,
                            begin_suppress_tokens=gc.begin_suppress_tokens)
    outs = llm.generate([{"prompt": "", "multi_modal_data": {"input_features": f}} for f in features], params,
                        use_tqdm=False)
    hf = WhisperForConditionalGeneration.from_pretrained(path).eval()
    refs = hf_tokens(hf, features)
    mine = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    for m, r in zip(mine, refs):
        assert m == r
    assert len({tuple(m) for m in mine}) > 1, mine


def test_multilingual_detects_language_and_uses_task_tokens(tmp_path, make_llm):
    llm = make_llm(make_whisper(tmp_path / "multi", multilingual=True, seed=3))
    detected = llm.transcribe(AUDIO / "coffee.wav", **EXACT)[0]
    assert detected.language in {"en", "de", "fr"}
    forced = llm.transcribe(AUDIO / "coffee.wav", language="fr", **EXACT)[0]
    assert forced.language == "fr"
    tokens = llm.engine.input_processor.default_decoder_prompt
    assert tokens == [50257, 50259, 50359, 50362]  # sot, en, transcribe, notimestamps
    with pytest.raises(ValueError, match="'xx' is not a language Whisper knows"):
        llm.transcribe(AUDIO / "coffee.wav", language="xx")


def test_chunked_detects_the_language_once_per_file(tmp_path, make_llm, monkeypatch):
    """The chunks of one input share one language, detected on its first window before they fan out."""
    llm = make_llm(make_whisper(tmp_path / "multi", multilingual=True, seed=3))
    added = record_requests(llm.engine, monkeypatch)
    out = llm.transcribe(AUDIO / "long_meeting.flac", chunked=True, clip_timestamps="0,50", temperatures=(0.0,))[0]
    monkeypatch.undo()
    prompts = [prompt["decoder_prompt"]["prompt_token_ids"] for _, prompt, _ in added]
    sot = 50257
    assert prompts.count([sot]) == 1  # one detection request
    languages = {p[p.index(sot) + 1] for p in prompts if p != [sot]}
    assert len(languages) == 1 and out.language is not None
    assert len({p.index(sot) for p in prompts if p != [sot]}) >= 1 and len(prompts) >= 3  # two chunks at least


def test_audio_prompt_file_runs(tiny_en):
    from encdec_engine.inputs.prompt_files import load_prompt_file

    entries = load_prompt_file(ROOT / "prompts" / "audio_prompts.jsonl")
    outs = tiny_en.generate([p for p, _ in entries],
                            [SamplingParams(**{"temperature": 0.0, "max_tokens": 60, **o}) for _, o in entries],
                            use_tqdm=False)
    assert norm(outs[0].outputs[0].text) == norm(TRANSCRIPTS["coffee.wav"])
    assert "beautiful day" in outs[1].outputs[0].text


def test_initial_prompt_matches_hf_prompt_ids(tiny_en, hf_tiny_en):
    text = "Stella brings things from the store."
    result = tiny_en.transcribe(AUDIO / "stella.wav", initial_prompt=text, **EXACT)[0]
    tok = tiny_en.get_tokenizer()
    prompt_ids = torch.tensor(tok.get_prompt_ids(text))
    features = log_mel_spectrogram([load_audio(AUDIO / "stella.wav")])
    with torch.no_grad():
        ref = hf_tiny_en.generate(input_features=features, prompt_ids=prompt_ids, return_dict_in_generate=True)
    ref = ref.sequences[0].tolist()
    assert ref[: len(prompt_ids)] == prompt_ids.tolist()  # HF returns prompt + <|startoftranscript|> ...
    assert result.segments[0].tokens + [50256] == ref[len(prompt_ids) + 2 :]


def test_initial_prompt_with_special_token_text_is_refused(tiny_en):
    with pytest.raises(ValueError, match="initial_prompt contains special-token text.*endoftext"):
        tiny_en.transcribe(AUDIO / "stella.wav", initial_prompt="Stella <|endoftext|> brings")


def test_nan_samples_are_an_input_error_not_a_crash(tiny_en):
    bad = np.full(16000, np.nan, dtype=np.float32)
    results = tiny_en.transcribe([bad, AUDIO / "stella.wav"], **EXACT)
    assert "16000 NaN or infinite samples" in results[0].error and results[1].error is None
    assert results[1].text.strip()


def test_a_short_input_keeps_hf_generates_max_length(tiny_en, monkeypatch):
    """Up to 30 s, HF's rule: the checkpoint's max_length (448) less the decoder prompt."""
    added = record_requests(tiny_en.engine, monkeypatch)
    tiny_en.transcribe(AUDIO / "weather.wav")
    monkeypatch.undo()
    (_, prompt, params), = added
    assert params.max_tokens == 448 - len(prompt["decoder_prompt"]["prompt_token_ids"])


def test_english_only_checkpoint_decodes_each_window_once(tiny_en):
    engine = tiny_en.engine
    before = engine.stats["prefill_steps"], engine.stats["encoder_runs"]
    tiny_en.transcribe(AUDIO / "coffee.wav", **EXACT)
    assert engine.stats["prefill_steps"] - before[0] == 1  # no separate language-detection pass
    assert engine.stats["encoder_runs"] - before[1] <= 1  # 0 when an earlier test cached this clip


def test_beam_search_matches_hf_on_tiny_en(tiny_en, hf_tiny_en):
    names = SHORT_CLIPS[:3]
    features = log_mel_spectrogram([load_audio(AUDIO / n) for n in names])
    gc = tiny_en.engine.generation_config
    params = SamplingParams(num_beams=4, n=1, max_tokens=446, suppress_tokens=gc.suppress_tokens,
                            begin_suppress_tokens=gc.begin_suppress_tokens)
    outs = tiny_en.generate([{"prompt": "", "multi_modal_data": {"input_features": f}} for f in features], params,
                            use_tqdm=False)
    for out, f in zip(outs, features):
        with torch.no_grad():
            ref = hf_tiny_en.generate(input_features=f[None], num_beams=4, return_dict_in_generate=True)
        assert out.prompt_token_ids + out.outputs[0].token_ids == ref.sequences[0].tolist()


def test_transcribe_beam_size_matches_hf_beam_search_with_timestamps(tiny_en, hf_tiny_en):
    names = SHORT_CLIPS[:3]
    results = tiny_en.transcribe([AUDIO / n for n in names], beam_size=5, temperatures=(0.0,))
    features = log_mel_spectrogram([load_audio(AUDIO / n) for n in names])
    for name, result, f in zip(names, results, features):
        with torch.no_grad():
            ref = hf_tiny_en.generate(input_features=f[None], num_beams=5, return_timestamps=True)[0].tolist()
        assert [t for s in result.segments for t in s.tokens] == [t for t in ref if t != 50256], name
        assert result.segments[0].tokens[0] >= tiny_en.engine.generation_config.no_timestamps_token_id + 1


def test_beam_avg_logprob_is_hf_sequence_score(tiny_en, hf_tiny_en):
    """length_penalty 1: HF's sequences_scores is the summed log-prob over the generated tokens
    (EOS included), which is the avg_logprob the fallback rule reads."""
    result = tiny_en.transcribe(AUDIO / "fox.wav", beam_size=4, **EXACT)[0]
    features = log_mel_spectrogram([load_audio(AUDIO / "fox.wav")])
    with torch.no_grad():
        ref = hf_tiny_en.generate(input_features=features, num_beams=4, return_dict_in_generate=True,
                                  output_scores=True)
    assert result.segments[0].avg_logprob == pytest.approx(float(ref.sequences_scores[0]), abs=1e-4)


@pytest.mark.parametrize("options, match", [(dict(beam_size=0), "beam_size"), (dict(best_of=1.5), "best_of"),
                                             (dict(beam_size=10_000), "max_num_seqs")])
def test_bad_beam_options_are_refused(tiny_en, options, match):
    with pytest.raises(ValueError, match=match):
        tiny_en.transcribe(AUDIO / "fox.wav", **options)


# -- no-speech probability --------------------------------------------------------
def hf_no_speech_prob(model, features: torch.Tensor, prompt: list[int], sot_index: int, token: int) -> float:
    """openai-whisper's definition: softmax of the raw logits after <|startoftranscript|>, at <|nospeech|>."""
    with torch.no_grad():
        logits = model(input_features=features[None], decoder_input_ids=torch.tensor([prompt])).logits
    return torch.softmax(logits[0, sot_index], -1)[token].item()


def test_no_speech_prob_matches_hf_logits_also_over_cached_prefixes(tiny_en, hf_tiny_en):
    from encdec_engine.checkpoints.whisper.tokens import WhisperTokens

    engine = tiny_en.engine
    tokens = WhisperTokens.from_configs(engine.hf_config, engine.generation_config)
    clips = [load_audio(AUDIO / SHORT_CLIPS[0]), torch.zeros(16000 * 3).numpy()]  # speech, then silence
    features = log_mel_spectrogram(clips)
    bs = engine.config.block_size
    text = " a long previous window of text that fills more than one whole block of the cache, and then some more"
    previous = tiny_en.get_tokenizer()(text, add_special_tokens=False)["input_ids"]
    # <|startoftranscript|> at 0; at the end of the first block (a full block the cache would reuse were the
    # position not held back); and in the second block (the first block is reused).
    prompts = [tokens.decoder_prompt(), tokens.decoder_prompt(previous=previous[: bs - 2]),
               tokens.decoder_prompt(previous=previous[: bs + 2])]
    assert [p.index(tokens.sot) for p in prompts] == [0, bs - 1, bs + 3] and len(prompts[1]) > bs
    params = SamplingParams(temperature=0.0, max_tokens=2, no_speech_token_id=tokens.no_speech)
    requests = [{"encoder_prompt": {"prompt": "", "multi_modal_data": {"input_features": f}},
                 "decoder_prompt": {"prompt_token_ids": p}} for f in features for p in prompts]
    hits = engine.block_manager.cache_stats["self_block_hits"]
    first = [o.no_speech_prob for o in tiny_en.generate(requests, params, use_tqdm=False)]
    again = [o.no_speech_prob for o in tiny_en.generate(requests, params, use_tqdm=False)]
    assert engine.block_manager.cache_stats["self_block_hits"] - hits == 2  # the third prompt's, once per clip
    refs = [hf_no_speech_prob(hf_tiny_en, f, p, p.index(tokens.sot), tokens.no_speech) for f in features for p in prompts]
    for mine, mine_again, ref in zip(first, again, refs):
        assert mine == pytest.approx(ref, abs=1e-5) and mine_again == pytest.approx(ref, abs=1e-5)
    assert first[0] < 0.3 < 0.6 < first[3], first  # speech vs silence
    assert tiny_en.generate(requests[:1], SamplingParams(max_tokens=1), use_tqdm=False)[0].no_speech_prob is None


def test_no_speech_prob_errors_name_the_problem(tiny_en):
    prompt = {"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": (torch.zeros(8000).numpy(), 16000)}},
              "decoder_prompt": {"prompt_token_ids": [50257, 50362]}}
    with pytest.raises(ValueError, match="no_speech_token_id 99999 is outside the vocabulary"):
        tiny_en.generate([prompt], SamplingParams(no_speech_token_id=99999), use_tqdm=False)
    with pytest.raises(ValueError, match="SamplingParams.no_speech_token_id must be a non-negative token id"):
        SamplingParams(no_speech_token_id=-1)
    # Prompts always open with the decoder start token; the position lookup still refuses one without it.
    with pytest.raises(ValueError, match=r"needs the decoder start token \(50257\) in the decoder prompt"):
        no_speech_position([50362], 50257)


def test_transcripts_report_no_speech_and_skip_silent_windows(tiny_en, hf_tiny_en):
    speech = tiny_en.transcribe(AUDIO / SHORT_CLIPS[0])[0]
    assert 0.0 < speech.segments[0].no_speech_prob < 0.3
    noise = (np.random.default_rng(0).standard_normal(16000 * 5) * 0.01).astype(np.float32)
    skipped = tiny_en.transcribe(noise)[0]  # high no-speech probability and an improbable text: skipped
    assert skipped.text == "" and skipped.segments == []
    kept = tiny_en.transcribe(noise, no_speech_threshold=None)[0]
    assert kept.text.strip() and kept.segments[0].no_speech_prob > 0.6


def test_language_may_be_a_code_token_or_name_in_any_case():
    from encdec_engine.checkpoints.whisper.tokens import WhisperTokens, language_code

    assert [language_code(x) for x in ("EN", "English", "<|fr|>", " de ", "castilian")] == ["en", "en", "fr", "de", "es"]
    english_only = WhisperTokens(sot=1, eot=0, no_timestamps=9, sot_prev=None, is_multilingual=False)
    assert english_only.decoder_prompt("English") == english_only.decoder_prompt("EN") == [1, 9]
    with pytest.raises(ValueError, match="English-only"):
        english_only.decoder_prompt("German")
    multi = WhisperTokens(sot=1, eot=0, no_timestamps=9, sot_prev=None, is_multilingual=True,
                          lang_to_id={"<|en|>": 3, "<|fr|>": 4}, task_to_id={"transcribe": 5})
    assert multi.decoder_prompt("French") == [1, 4, 5, 9]


@pytest.mark.parametrize("head_dim, folds", [(64, True), (48, False)])
def test_query_scaling_folds_into_the_projection_bit_for_bit(head_dim, folds):
    """Whisper scales q after its projection; folded into the q rows at load (a power-of-two scaling
    only) it gives the same bits, in fp32 and through the int8 linears."""
    import copy

    from encdec_engine.attention.backends.torch_sdpa import TorchSDPABackend
    from encdec_engine.attention.metadata import AttentionMetadata, AttentionType, AttentionView
    from encdec_engine.quantization.int8_weights import quantize_linears
    from encdec_engine.models.encdec_layers import EncDecAttention

    torch.manual_seed(0)
    heads = 3
    attn = EncDecAttention(heads * head_dim, heads, AttentionType.ENCODER, TorchSDPABackend(16), prescale_query=True)
    for p in attn.parameters():
        p.data.normal_(0, 0.3)
    x = torch.randn(7, heads * head_dim)
    view = AttentionView.from_arrays([0, 7], [7], causal=False, key_start_loc=[0])
    metadata = AttentionMetadata(decoder=None, encoder=view)
    plain = copy.deepcopy(attn)
    assert attn.fold_query_scaling() is folds
    assert torch.equal(attn.qkv_proj.weight[: heads * head_dim] != plain.qkv_proj.weight[: heads * head_dim],
                       torch.full_like(attn.qkv_proj.weight[: heads * head_dim], folds, dtype=torch.bool))
    with torch.inference_mode():
        assert torch.equal(attn(x, None, metadata), plain(x, None, metadata))
        quantize_linears(attn)
        quantize_linears(plain)
        assert torch.equal(attn(x, None, metadata), plain(x, None, metadata))
    assert not attn.fold_query_scaling()  # once only


@pytest.mark.parametrize("kernel", [True, False])
def test_a_lone_sequence_reads_its_caches_in_place(kernel, make_llm, monkeypatch):
    """One request decoding alone (the one-file job): every decode step reads both contexts in place, none
    gathered: through the compiled kernel, or (without it) as slices, its cross table being a run and its
    self table growing into the blocks after it."""
    from encdec_engine.attention.backends.torch_sdpa import PagedDecodePlan, SlicePlan

    llm = make_llm(default_model_path(), enable_prefix_caching=False)
    backend, plans = llm.engine.runner.backend, []
    if kernel and backend.fused_decode is None:
        pytest.skip("the decode kernel does not build here")
    if not kernel:
        monkeypatch.setattr(backend, "fused_decode", None)
    plan = backend.plan

    def recording_plan(metadata):
        plan(metadata)
        if metadata.decoder.max_query_len == 1:
            plans.append((type(metadata.decoder.plan), type(metadata.cross.plan)))

    monkeypatch.setattr(backend, "plan", recording_plan)
    features = log_mel_spectrogram([load_audio(AUDIO / "weather.wav")])[0]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)  # the self table spans 3 blocks
    llm.generate([{"prompt": "", "multi_modal_data": {"input_features": features}}], params, use_tqdm=False)
    expected = PagedDecodePlan if kernel else SlicePlan
    assert len(plans) == 39 and set(plans) == {(expected, expected)}
