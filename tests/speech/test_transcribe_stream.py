"""The Python API's streaming shapes (LLM.transcribe_iter, LLM.transcribe_segments) on `LLM()`, the offline
default, and the openai-whisper options built here: carry_initial_prompt and the word punctuation rules."""

import re
from pathlib import Path

import pytest
import torch
from helpers import record_requests

from encdec_engine import LLM
from encdec_engine.speech.job import TranscriptionJob
from encdec_engine.speech.options import TranscribeOptions
from encdec_engine.speech.requests import WindowRequests

AUDIO = Path(__file__).resolve().parents[2] / "prompts" / "audio"
MEETING = AUDIO / "long_meeting.flac"  # 69 s: three windows
GREEDY = dict(temperatures=(0.0,))


@pytest.fixture(scope="module")
def default_llm():
    """`LLM()` with no model and one thread: the bundled tiny.en, torch set to 1 thread."""
    from conftest import _ENGINES

    threads = torch.get_num_threads()
    llm = LLM(num_kv_blocks=600, threads=1)
    assert (llm.engine.threads, torch.get_num_threads()) == (1, 1)
    _ENGINES.add(llm.engine)  # checked for leaked blocks after every test
    yield llm
    torch.set_num_threads(threads)


def test_llm_without_a_model_is_the_offline_tiny_en(default_llm):
    engine = default_llm.engine
    assert engine.config.model == "tiny.en" and engine.hf_config.vocab_size == 51864  # English-only
    assert engine.describe().startswith("model tiny.en (WhisperForConditionalGeneration) on cpu, float32, "
                                        "1 CPU threads, KV pool of 600 blocks x 16 tokens")


def test_transcribe_iter_yields_each_file_when_it_is_done(default_llm):
    files = [MEETING, AUDIO / "coffee.wav", AUDIO / "missing.wav"]
    done = list(default_llm.transcribe_iter(files, **GREEDY))
    # Completion order: the unreadable file at once, the short clip, then the 3-window meeting.
    assert [t.index for t in done] == [2, 1, 0]
    assert "missing.wav" in done[0].error and "coffee with milk" in done[1].text
    listed = default_llm.transcribe(files, **GREEDY)  # the same, in input order
    assert [t.index for t in listed] == [0, 1, 2] and [t.text for t in listed] == [t.text for t in reversed(done)]


def test_leaving_transcribe_iter_early_aborts_the_rest(default_llm):
    engine = default_llm.engine
    for t in default_llm.transcribe_iter([MEETING, AUDIO / "coffee.wav"], **GREEDY):
        assert t.index == 1 and engine.has_unfinished_requests()  # the meeting is still being decoded
        break
    assert not engine.has_unfinished_requests() and engine.num_free_blocks() == engine.num_total_blocks()
    assert default_llm.transcribe(AUDIO / "coffee.wav")[0].index == 0  # the LLM is free again


def test_progress_counts_seconds_of_audio_and_files_with_a_realtime_rate(default_llm, capsys):
    default_llm.transcribe([AUDIO / "coffee.wav", AUDIO / "weather.wav"], use_tqdm=True, **GREEDY)
    bar = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert re.search(r"\| 6\.8/6\.8 s of audio \[.*, \d+\.\dx realtime, files 2/2\]$", bar), bar  # 3.49 + 3.30 s
    assert "s/s" not in bar


def test_segments_are_decoded_as_they_are_iterated(default_llm):
    """faster-whisper's lazy generator: nothing runs before the first `next`, the next window waits in the
    engine while the caller holds a segment, and closing the stream aborts it and frees its blocks."""
    engine = default_llm.engine
    stream = default_llm.transcribe_segments(MEETING, **GREEDY)
    assert not engine.has_unfinished_requests()
    first = next(stream)
    assert first.id == 0 and first.start == 0.0 and stream.language == "en" and round(stream.duration) == 69
    assert stream.transcription is None and engine.has_unfinished_requests()  # window 2 is queued, not run
    with pytest.raises(RuntimeError, match="busy with an unfinished transcribe_segments stream"):
        default_llm.transcribe(AUDIO / "coffee.wav")
    stream.close()
    assert not engine.has_unfinished_requests() and engine.num_free_blocks() == engine.num_total_blocks()
    assert "coffee" in default_llm.transcribe(AUDIO / "coffee.wav")[0].text  # free for other calls again


@pytest.mark.parametrize("chunked", [False, True])
def test_a_streams_segments_are_its_transcript_in_order(default_llm, chunked):
    """Windows (or chunks, which finish in any order) hand out their segments once, numbered in time order."""
    stream = default_llm.transcribe_segments(MEETING, chunked=chunked, **GREEDY)
    segments = list(stream)
    assert len(segments) > 3 and [s.id for s in segments] == list(range(len(segments)))
    assert segments == stream.transcription.segments
    assert [s.start for s in segments] == sorted(s.start for s in segments)


def test_segment_stream_errors(default_llm, tmp_path):
    stream = default_llm.transcribe_segments(tmp_path / "missing.wav")
    with pytest.raises(ValueError, match="missing.wav"):
        next(stream)
    with pytest.raises(ValueError, match="takes one input, got 2"):
        default_llm.transcribe_segments([MEETING, MEETING])


def previous_text(llm, options: TranscribeOptions, job: TranscriptionJob) -> list[int]:
    """The <|startofprev|> context of the job's next decode request."""
    requests = WindowRequests(llm.engine, options, _tokens(llm))
    decoder = requests.build(job, torch.zeros(80, 3000))[0]["decoder_prompt"]["prompt_token_ids"]
    sot_prev, sot = llm.engine.generation_config.prev_sot_token_id, llm.engine.hf_config.decoder_start_token_id
    return decoder[1 : decoder.index(sot)] if decoder[0] == sot_prev else []


def _tokens(llm):
    from encdec_engine.checkpoints.whisper.tokens import WhisperTokens

    return WhisperTokens.from_configs(llm.engine.hf_config, llm.engine.generation_config)


def test_carry_initial_prompt_is_openai_whispers(default_llm):
    """openai-whisper's transcribe(): with carry_initial_prompt each window's prompt is the initial prompt,
    then the last `n_text_ctx // 2 - 1 - len(initial)` tokens since the last prompt reset; without it, the
    last n_text_ctx // 2 - 1 tokens of initial + text, so a long transcript pushes the prompt out."""
    tok = default_llm.get_tokenizer()
    limit = 448 // 2 - 1
    text = tok(" ".join(f"word{i}" for i in range(150)), add_special_tokens=False)["input_ids"]
    job = TranscriptionJob(0, None, language="en", tokens=list(text))
    assert len(text) > limit
    for words in (10, 400):  # a prompt that leaves room, and one that fills the context alone
        prompt = " ".join(["hello"] * words)
        initial = tok(" " + prompt, add_special_tokens=False)["input_ids"]
        carried = TranscribeOptions(initial_prompt=prompt, carry_initial_prompt=True)
        plain = TranscribeOptions(initial_prompt=prompt)
        if len(initial) < limit:
            assert previous_text(default_llm, carried, job) == initial + text[-(limit - len(initial)):]
        else:  # "left-sliced to make space"
            assert previous_text(default_llm, carried, job) == initial[-limit:]
        assert previous_text(default_llm, plain, job) == (initial + text)[-limit:]
    prompt = "Minutes of the meeting."
    initial = tok(" " + prompt, add_special_tokens=False)["input_ids"]
    job.prompt_reset = len(text) - 5  # a window decoded hotter than 0.5 resets the text, not the carried prompt
    carried = TranscribeOptions(initial_prompt=prompt, carry_initial_prompt=True)
    assert previous_text(default_llm, carried, job) == initial + text[-5:]
    alone = TranscribeOptions(initial_prompt=prompt, carry_initial_prompt=True, condition_on_previous_text=False)
    assert previous_text(default_llm, alone, job) == initial


def test_carried_prompt_leads_every_window_end_to_end(default_llm, monkeypatch):
    tok = default_llm.get_tokenizer()
    prompt = " ".join(["minutes"] * 150)  # with the meeting's text, more than the context holds
    initial = tok(" " + prompt, add_special_tokens=False)["input_ids"]
    added = record_requests(default_llm.engine, monkeypatch)
    default_llm.transcribe(MEETING, initial_prompt=prompt, carry_initial_prompt=True, **GREEDY)
    decodes = [p["decoder_prompt"]["prompt_token_ids"] for _, p, _ in added]
    sot_prev = default_llm.engine.generation_config.prev_sot_token_id
    assert len(decodes) >= 3 and all(d[: 1 + len(initial)] == [sot_prev, *initial] for d in decodes)


def test_punctuation_marks_join_words_as_asked(default_llm):
    """openai-whisper's append_punctuations: listed marks join the previous word; unlisted, they stay words."""
    def words(**options):
        t = default_llm.transcribe(AUDIO / "weather.wav", word_timestamps=True, no_speech_threshold=None,
                                   **options)[0]
        found = [w.word for s in t.segments for w in s.words]
        assert "".join(found) == t.text
        return found

    assert words()[-1] == " park."
    assert words(append_punctuations="")[-2:] == [" park", "."]


def test_the_progress_bar_ends_exactly_at_its_total_and_shows_the_vad_phase(tmp_path, capsys, make_llm):
    """It used to overshoot (tqdm's "clamping frac" warning, a negative time left) or stop at 99.9%: each
    window's rounded advance was summed as float seconds. It counts whole frames now, and a file whose
    header says nothing (m4a) or whose windows skip silence still ends the bar at its total; with VAD
    the bar names the phase that finds the speech."""
    import subprocess

    from encdec_engine.checkpoints.ct2.importer import default_model_path

    m4a = tmp_path / "weather.m4a"
    subprocess.run(["ffmpeg", "-v", "error", "-i", str(AUDIO / "weather.wav"), str(m4a)], check=True)
    llm = make_llm(default_model_path())
    files = [AUDIO / "long_meeting.flac", AUDIO / "fox.wav", m4a]
    for vad in (False, True):
        llm.transcribe(files, use_tqdm=True, vad_filter=vad)
        lines = [line.strip() for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if line.strip()]
        last = lines[-1]
        n, total = last.split("|")[2].split(" s of audio")[0].split("/")
        assert float(n) == float(total) > 70 and "100%" in last and "files 3/3" in last, last
        assert not any("clamping" in line or "-" in line.split("<")[-1][:3] for line in lines), lines
        assert any(line.startswith("Finding speech (VAD)") for line in lines) == vad
        # The VAD phase advances and shows its end, also in a log: it sat at 0% until the first window.
        searched = [line.split("speech searched in ")[1] for line in lines if "speech searched in" in line]
        assert bool(searched) == vad
        if vad:
            done, total = searched[-1].split(" s]")[0].split("/")
            assert float(done) == float(total) > 70, searched


def test_the_progress_bar_is_drawn_when_its_phase_changes_not_at_every_step(capsys):
    """Each engine step named the phase again, and tqdm's set_description_str draws the bar at once: a
    log (stderr not a terminal) got a copy of the bar per step. Naming the current phase draws nothing."""
    from encdec_engine.speech.offline import FINDING_SPEECH, TRANSCRIBING, _Progress

    progress = _Progress([12.0, None], enabled=True, phase=FINDING_SPEECH)
    capsys.readouterr()
    for _ in range(5):
        progress.phase(FINDING_SPEECH)
    assert capsys.readouterr().err == ""
    progress.phase(TRANSCRIBING)
    progress.phase(TRANSCRIBING)
    assert capsys.readouterr().err.count("\r") == 1
    progress.bar.close()
