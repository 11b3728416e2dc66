"""The two drivers of the speech pipeline run the same Transcriber: `transcribe_offline` (LLM.transcribe,
over LLMEngine.step) and `transcribe_async` (the server, over AsyncLLMEngine). Both detect a chunked
input's language once and then fan its chunks out, send the same requests and give the same transcript."""

import asyncio
from pathlib import Path

import pytest
from helpers import make_whisper, record_requests

from encdec_engine.engine.async_engine import AsyncLLMEngine
from encdec_engine.speech.async_driver import transcribe_async
from encdec_engine.speech.offline import transcribe_offline
from encdec_engine.speech.options import TranscribeOptions
from encdec_engine.speech.transcriber import Transcriber

AUDIO = Path(__file__).resolve().parents[2] / "prompts" / "audio"
MEETING = AUDIO / "long_meeting.flac"
CHUNKED = TranscribeOptions(chunked=True, clip_timestamps="0,50", temperatures=(0.0,))  # 50 s: two chunks


class Slots:
    """A queue ticket that counts: it holds the input's first slot, as the server's does."""

    def __init__(self) -> None:
        self.held, self.added, self.released = 1, 0, 0

    def add(self, n: int) -> None:
        self.held += n
        self.added += n

    def release(self, n: int = 1) -> None:
        assert self.held >= n, "released a slot that was never held"
        self.held -= n
        self.released += n


def whisper(tmp_path, make_llm, multilingual: bool):
    return make_llm(make_whisper(tmp_path / "w", "tiny-80", multilingual=multilingual, seed=3))


def run_async(engine, options: TranscribeOptions, audio):
    """transcribe_async on an AsyncLLMEngine around `engine`: (transcript, job, slots, outputs)."""
    async def main():
        async_engine = AsyncLLMEngine(engine)
        async_engine.start()
        try:
            transcriber = Transcriber(engine, options)
            job, slots = transcriber.load(0, audio), Slots()
            outs = [out async for out in transcribe_async(async_engine, transcriber, job, "t", slots)]
            return transcriber.result(job), job, slots, outs
        finally:
            await async_engine.shutdown()

    return asyncio.run(main())


def prompts(added) -> list[list[int]]:
    return [prompt["decoder_prompt"]["prompt_token_ids"] for _, prompt, _ in added]


def detections(added) -> list[int]:
    """The indices of the language-detection requests (one token among the language tokens)."""
    return [i for i, (_, _, params) in enumerate(added) if params.allowed_token_ids is not None]


@pytest.mark.parametrize("multilingual", [True, False], ids=["multilingual", "english-only"])
def test_both_drivers_detect_the_language_once_then_fan_the_chunks_out(tmp_path, make_llm, monkeypatch,
                                                                       multilingual):
    llm = whisper(tmp_path, make_llm, multilingual)
    added = record_requests(llm.engine, monkeypatch)
    offline = transcribe_offline(llm.engine, CHUNKED, MEETING)[0]
    offline_prompts, offline_detections = prompts(added), detections(added)
    added.clear()
    result, job, slots, outs = run_async(llm.engine, CHUNKED, MEETING)
    async_prompts = prompts(added)

    # Once, before any chunk's request.
    assert offline_detections == detections(added) == ([0] if multilingual else [])
    assert len(job.parts) == 2 and all(part.language == job.language for part in job.parts)
    assert sorted(async_prompts) == sorted(offline_prompts)  # the same requests; the chunks in any order
    assert result.language == offline.language and result.text == offline.text
    assert [(s.id, s.start, s.end, s.text) for s in result.segments] == \
           [(s.id, s.start, s.end, s.text) for s in offline.segments]
    assert sum(out.finished for out in outs) == len(async_prompts)  # every request's outputs came through
    # One slot per job until its first output: the detection's (multilingual), then each chunk's.
    assert slots.held == 0 and slots.released == len(job.parts) + multilingual
    assert slots.added == len(job.parts) - (0 if multilingual else 1)


def test_every_request_of_every_chunk_has_its_own_id(tmp_path, make_llm, monkeypatch):
    """Each chunk's requests are numbered under its own part: a chunk's later requests (here the fallback
    to a second temperature, which a log-probability threshold of 0 always asks for) took the last chunk's
    prefix, so two chunks' second requests shared an id, and the engine refused whichever came second
    while the other ran (a 400 on the server)."""
    llm = whisper(tmp_path, make_llm, multilingual=False)
    engine = llm.engine
    add, ids = engine.add_processed, []

    def recording_add(request_id, *args):
        ids.append(request_id)
        return add(request_id, *args)

    monkeypatch.setattr(engine, "add_processed", recording_add)
    fallback = TranscribeOptions(chunked=True, clip_timestamps="0,50", temperatures=(0.0, 1.0), logprob_threshold=0.0)
    _, job, _, _ = run_async(engine, fallback, MEETING)
    assert len(job.parts) == 2 and len(ids) == 2 * len(job.parts)  # each chunk: two temperatures
    assert len(set(ids)) == len(ids), ids
    assert sorted(ids) == [f"t-part{p}-{n}" for p in range(2) for n in range(2)]


def test_a_failing_chunk_stops_the_others_and_frees_their_blocks(tmp_path, make_llm, monkeypatch):
    llm = whisper(tmp_path, make_llm, multilingual=False)
    engine = llm.engine
    add = engine.add_processed  # where both drivers' requests are queued

    def refuse_the_second_chunk(request_id, *args):
        if "-part1-" in request_id:
            raise ValueError("refused for the test")
        return add(request_id, *args)

    monkeypatch.setattr(engine, "add_processed", refuse_the_second_chunk)
    with pytest.raises(ValueError, match="refused for the test"):
        run_async(engine, CHUNKED, MEETING)
    assert not engine.has_unfinished_requests()  # the first chunk's request was aborted
    assert engine.num_free_blocks() == engine.num_total_blocks()


def test_a_window_is_yielded_before_its_job_takes_it(tmp_path, make_llm):
    """What a stream relies on: at a request's last output the job's segments do not hold that window
    yet (the server sends committed text + the window's text)."""
    llm = whisper(tmp_path, make_llm, multilingual=False)
    options = TranscribeOptions(clip_timestamps="0,50", temperatures=(0.0,))  # windows one after another

    async def main():
        async_engine = AsyncLLMEngine(llm.engine)
        async_engine.start()
        try:
            transcriber = Transcriber(llm.engine, options)
            job = transcriber.load(0, MEETING)
            taken = [job.window async for out in transcribe_async(async_engine, transcriber, job, "t")
                     if out.finished]
            return taken, job
        finally:
            await async_engine.shutdown()

    taken, job = asyncio.run(main())
    assert taken == list(range(job.window)) and job.window >= 2
