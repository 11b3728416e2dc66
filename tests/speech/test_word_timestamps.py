"""Word timestamps: the alignment (DTW path and token probabilities) against CTranslate2's, the
pieces against their references, and transcripts with words end to end."""

import json
import re
from pathlib import Path

import jiwer
import numpy as np
import pytest
import torch

from encdec_engine import SamplingParams
from encdec_engine.inputs.audio import load_audio
from encdec_engine.inputs.features import log_mel_spectrogram
from encdec_engine.checkpoints.ct2.bundled import bundled_model_dir
from encdec_engine.checkpoints.ct2.importer import default_model_path
from encdec_engine.speech.word_timestamps import (WordTiming, alignment_heads, alignment_path, dtw, median_filter,
                                           merge_punctuations, split_to_word_tokens)

ROOT = Path(__file__).resolve().parents[2]
AUDIO = ROOT / "prompts" / "audio"
EOT = 50256


def reference_dtw(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """openai-whisper's loop, cell by cell."""
    n, m = x.shape
    cost = np.full((n + 1, m + 1), np.inf, dtype=np.float32)
    trace = -np.ones((n + 1, m + 1), dtype=np.float32)
    cost[0, 0] = 0
    for j in range(1, m + 1):
        for i in range(1, n + 1):
            c0, c1, c2 = cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1]
            if c0 < c1 and c0 < c2:
                c, t = c0, 0
            elif c1 < c0 and c1 < c2:
                c, t = c1, 1
            else:
                c, t = c2, 2
            cost[i, j] = x[i - 1, j - 1] + c
            trace[i, j] = t
    trace[0, :], trace[:, 0] = 2, 1
    i, j, path = n, m, []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        i, j = {0: (i - 1, j - 1), 1: (i - 1, j), 2: (i, j - 1)}[int(trace[i, j])]
    path = np.array(path[::-1])
    return path[:, 0], path[:, 1]


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (7, 1), (5, 40), (23, 17)])
@pytest.mark.parametrize("ties", [False, True])
def test_dtw_equals_the_reference_loop(shape, ties):
    rng = np.random.default_rng(sum(shape) + ties)
    for _ in range(5):
        x = rng.integers(-2, 3, shape).astype(np.float64) if ties else rng.standard_normal(shape)
        got, want = dtw(x), reference_dtw(x)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def test_median_filter_is_a_mirrored_sliding_median():
    scipy_ndimage = pytest.importorskip("scipy.ndimage")
    x = torch.randn(3, 5, 50)
    want = scipy_ndimage.median_filter(x.numpy(), size=(1, 1, 7), mode="mirror")
    assert np.allclose(median_filter(x, 7).numpy(), want)
    assert torch.equal(median_filter(x[..., :3], 7), x[..., :3])  # too short to filter


@pytest.mark.parametrize("text, split, merged", [
    (' He said "hello, world." then left', [" He", " said", ' "hello', ",", ' world."', " then", " left"],
     [" He", " said", ' "hello,', ' world."', " then", " left"]),
    (" Well (I think) it's fine!", [" Well", " (I", " think", ")", " it's", " fine", "!"],
     [" Well", " (I", " think)", " it's", " fine!"]),
])
def test_words_split_at_spaces_and_punctuation_then_punctuation_merges(text, split, merged, make_llm):
    tok = make_llm(default_model_path()).get_tokenizer()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    words, word_tokens = split_to_word_tokens(tok, ids + [EOT], EOT, "en")
    assert words == split + ["<|endoftext|>"] and sum(word_tokens, []) == ids + [EOT]
    timings = [WordTiming(w, t, 0.0, 0.0, 1.0) for w, t in zip(words, word_tokens)]
    merge_punctuations(timings, "\"'“¿([{-", "\"'.。,，!！?？:：”)]}、")
    assert [w.word for w in timings if w.word] == merged + ["<|endoftext|>"]
    assert sum((w.tokens for w in timings), []) == ids + [EOT]


def test_languages_without_spaces_split_at_whole_characters(make_llm):
    tok = make_llm(default_model_path()).get_tokenizer()
    ids = tok("你好世界", add_special_tokens=False)["input_ids"]
    pieces, piece_tokens = split_to_word_tokens(tok, ids, EOT, "zh")
    assert "".join(pieces) == "你好世界" and all("\ufffd" not in p for p in pieces)
    assert sum(piece_tokens, []) == ids and len(pieces) > 1


def test_alignment_path_and_word_probabilities_equal_ctranslate2(make_llm):
    """The same window through CTranslate2's align (what faster-whisper calls): the DTW path is
    identical and the text-token probabilities agree to 1e-4."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    llm = make_llm(default_model_path())
    audio = load_audio(AUDIO / "long_meeting.flac")[: 30 * 16000]
    features = log_mel_spectrogram([audio])
    text = [t for t in llm.transcribe((audio, 16000), timestamps=False, temperatures=(0.0,))[0].segments[0].tokens
            if t < EOT]
    prefix = [50257, 50362]  # <|startoftranscript|> <|notimestamps|> (tiny.en)
    heads = alignment_heads(llm.engine.generation_config, 4, 6)
    prompt = {"encoder_prompt": {"prompt": "", "multi_modal_data": {"input_features": features[0]}},
              "decoder_prompt": {"prompt_token_ids": prefix + text + [EOT]}}
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0, allowed_token_ids=list(range(EOT)),
                                                cross_attention_heads=heads), use_tqdm=False)[0]
    text_indices, time_indices = alignment_path(out.cross_attentions, len(prefix), 3000)
    ct2 = ctranslate2.models.Whisper(str(bundled_model_dir()), device="cpu",
                                     compute_type="float32", intra_threads=2)
    ref = ct2.align(ct2.encode(ctranslate2.StorageView.from_array(features.numpy())), [50257], [text], [3000])[0]
    assert np.array_equal(np.stack([text_indices, time_indices], axis=1), np.array(ref.alignments))
    probs = [np.exp(out.prompt_logprobs[len(prefix) + k][t]) for k, t in enumerate(text)]
    assert np.allclose(probs, ref.text_token_probs, atol=1e-4)


def test_transcripts_carry_timed_words(make_llm):
    llm = make_llm(default_model_path())
    files = [AUDIO / "long_meeting.flac", AUDIO / "stella.wav"]
    plain = llm.transcribe(files)
    timed = llm.transcribe(files, word_timestamps=True)
    for p, t in zip(plain, timed):
        assert t.error is None and plain[0].segments[0].words is None
        previous_end = 0.0
        for seg in t.segments:
            words = seg.words
            assert words and "".join(w.word for w in words) == seg.text
            # Each segment moves to its words, unless a word came out too long (then the word is cut).
            assert abs(seg.start - words[0].start) <= 0.7 and abs(seg.end - words[-1].end) <= 0.7
            for w in words:
                assert previous_end - 0.01 <= w.start <= w.end <= t.duration + 0.5, (w, previous_end)
                assert 0.0 < w.probability <= 1.0
                previous_end = w.end
        reference = json.loads((AUDIO / "transcripts.json").read_text())[Path(t.source).name]

        def norm(s):
            return " ".join(re.sub(r"[^a-z0-9' ]", " ", s.lower()).split())

        assert jiwer.wer(norm(reference), norm(t.text)) <= jiwer.wer(norm(reference), norm(p.text)) + 0.02


def test_alignment_heads_default_to_the_upper_half_of_the_decoder():
    from transformers import GenerationConfig

    assert alignment_heads(GenerationConfig(), 4, 2) == [(2, 0), (2, 1), (3, 0), (3, 1)]
    assert alignment_heads(GenerationConfig(alignment_heads=[[1, 0], [3, 5]]), 4, 6) == [(1, 0), (3, 5)]


def test_windows_that_cannot_be_aligned_keep_their_segments_without_words(make_llm):
    """Too short to align (one encoder position), or text too long for the decoder with the
    alignment prefix: the segments stay, with no words, and nothing fails."""
    from encdec_engine.speech.job import DecodedWindow
    from encdec_engine.speech.options import TranscribeOptions
    from encdec_engine.speech.results import Segment
    from encdec_engine.speech.transcriber import Transcriber

    llm = make_llm(default_model_path())
    noise = np.random.default_rng(0).standard_normal(320).astype(np.float32) * 0.1  # 20 ms
    result = llm.transcribe((noise, 16000), word_timestamps=True, no_speech_threshold=None)[0]
    assert result.error is None and all(s.words == [] for s in result.segments)
    transcriber = Transcriber(llm.engine, TranscribeOptions(word_timestamps=True))
    job = transcriber.load(0, AUDIO / "fox.wav")
    window = DecodedWindow([Segment(0, 0.0, 3.0, " the" * 446, [262] * 446)], 372, 0.0, 372, True, 0.0)
    assert not transcriber.requests.can_align(job, window)
    window.segments[0].tokens = [262] * 445
    assert transcriber.requests.can_align(job, window)  # 2 prefix tokens + 445 + EOT = 448 positions
