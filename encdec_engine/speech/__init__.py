"""The speech pipeline: audio in, timed text out, through the model-agnostic engine; for llm.py, server/ and cli/.

    transcriber.py, job.py     the window loop (openai-whisper's transcribe(), as engine requests): audio,
                               clips and seek; decode, temperature fallback, silence; words, hallucination
                               cuts; conditioning. job.py declares the per-input state only the loop moves
    requests.py, prompts.py    each window's engine request, and its decoder prompt
    timestamp_rules.py         the timestamp logits processor those requests carry
    ranking.py, fallback.py    which candidate a window keeps; kept, retried hotter, or silence
    assembly.py                segments from a window's tokens, and the Transcription
    word_timestamps.py, hallucinations.py   word times from the cross-attention (DTW); which words
                                            look hallucinated in silence
    chunking.py                quiet-point cuts of long audio (chunked mode)
    vad.py, vad_options.py     Silero VAD, batched, and its options (faster-whisper's VadOptions)
    timeline.py                speech spans joined end to end, and their times mapped back
    inputs.py                  inputs read as they are needed, within the audio budget
    offline.py, async_driver.py  the drivers: LLMEngine.step (LLM.transcribe) and AsyncLLMEngine (server)
    options.py, results.py     TranscribeOptions in; Transcription, Segment, Word out
    writers.py, subtitles.py   txt / vtt / srt / tsv / json files, and subtitle cues
    live/                      live transcription: a stream transcribed while it is spoken (docs/live.md)

The engine core (engine/, worker/, attention/, models/, layers/) never imports this package; audio
loading and the log-mel (inputs/audio.py, inputs/features.py) sit below it, in inputs/.
"""

from encdec_engine.speech.options import TranscribeOptions
from encdec_engine.speech.results import Segment, Transcription, Word

__all__ = ["TranscribeOptions", "Transcription", "Segment", "Word"]
