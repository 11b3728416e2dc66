"""The speech pipeline: audio in, timed text out, through the model-agnostic engine.

    audio.py, features.py      loading (any format, 16 kHz mono) and the Whisper log-mel
    windows.py, chunking.py    which 30 s windows are decoded: clips, seeking, quiet-point chunks
    requests.py, fallback.py   each window's engine request, and temperature fallback
    timestamp_rules.py         the timestamp logits processor those requests carry
    assembly.py                segments from tokens, words (word_timestamps.py), hallucination
                               cuts (hallucinations.py), the Transcription
    transcriber.py, job.py     one input as a series of requests, for any driver
    offline.py, async_driver.py  the drivers: LLMEngine.step (LLM.transcribe) and AsyncLLMEngine (server)
    options.py, results.py     TranscribeOptions in; Transcription, Segment, Word out

The engine core (engine/, worker/, attention/, models/, layers/) never imports this package;
inputs/ uses audio.py and features.py for the audio prompt format.
"""

from encdec_engine.speech.options import TranscribeOptions
from encdec_engine.speech.results import Segment, Transcription, Word

__all__ = ["TranscribeOptions", "Transcription", "Segment", "Word"]
