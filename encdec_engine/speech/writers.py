"""Transcript writers: txt, vtt, srt, tsv and json, the way openai-whisper's CLI writes them.

The formats follow openai-whisper's ``whisper/utils.py`` (``format_timestamp`` and the
``Write*`` result writers) so that files from this engine can be diffed against files
from ``whisper audio.wav --output_format ...``. ``render`` gives one format as a string
(stdout, the HTTP server's response bodies); ``write_transcription`` saves formats to files.
``SubtitleOptions`` (openai-whisper's word options) shape the srt and vtt cues; see ``subtitles``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from encdec_engine.files import write_atomically
from encdec_engine.speech.subtitles import SubtitleOptions, check_words, subtitle_cues
from encdec_engine.speech.results import Segment, Transcription

OUTPUT_FORMATS: tuple[str, ...] = ("txt", "vtt", "srt", "tsv", "json")
ALL_FORMATS = "all"  # the CLI's --output-format value for "every format"

# Used for the file name when neither the caller nor the transcript names an audio file
# (audio from stdin or from bytes in memory).
DEFAULT_BASENAME = "audio"


def format_timestamp(seconds: float, always_include_hours: bool = False, decimal_marker: str = ".") -> str:
    """Format ``seconds`` as ``[HH:]MM:SS<marker>mmm``.

    The time is rounded to whole milliseconds first and then split, so 59.9996 s gives
    ``01:00.000`` rather than ``00:60.000``. The hours field appears when the time reaches
    an hour or when ``always_include_hours`` is set (SRT needs it; VTT may omit it).
    """
    # openai-whisper asserts; a ValueError survives ``python -O`` and names the value.
    if not seconds >= 0:  # also rejects NaN
        raise ValueError(f"non-negative timestamp expected, got {seconds!r}")
    milliseconds = round(seconds * 1000.0)
    hours, milliseconds = divmod(milliseconds, 3_600_000)
    minutes, milliseconds = divmod(milliseconds, 60_000)
    secs, milliseconds = divmod(milliseconds, 1_000)
    hours_marker = f"{hours:02d}:" if always_include_hours or hours > 0 else ""
    return f"{hours_marker}{minutes:02d}:{secs:02d}{decimal_marker}{milliseconds:03d}"


def _render_txt(t: Transcription, options: SubtitleOptions) -> str:
    """One stripped segment text per line."""
    return "".join(f"{s.text.strip()}\n" for s in t.segments)


def _render_vtt(t: Transcription, options: SubtitleOptions) -> str:
    """WebVTT: a ``WEBVTT`` header, then ``start --> end`` cues with "." and optional hours."""
    parts = ["WEBVTT\n\n"]
    for cue in subtitle_cues(t, options):
        parts.append(f"{format_timestamp(cue.start)} --> {format_timestamp(cue.end)}\n{cue.text}\n\n")
    return "".join(parts)


def _render_srt(t: Transcription, options: SubtitleOptions) -> str:
    """SubRip: 1-based cue numbers, ``HH:MM:SS,mmm`` times (hours always), a blank line after each cue."""
    return "".join(f"{i}\n{_srt_time(cue.start)} --> {_srt_time(cue.end)}\n{cue.text}\n\n"
                   for i, cue in enumerate(subtitle_cues(t, options), start=1))


def _srt_time(seconds: float) -> str:
    return format_timestamp(seconds, always_include_hours=True, decimal_marker=",")


def _render_tsv(t: Transcription, options: SubtitleOptions) -> str:
    """``start<TAB>end<TAB>text`` with integer milliseconds.

    Integer milliseconds keep a locale's decimal comma out of the numbers; tabs and line
    breaks in the text become spaces so each segment stays one row of exactly three columns.
    """
    rows = ["start\tend\ttext\n"]
    for s in t.segments:
        text = " ".join(s.text.strip().replace("\t", " ").splitlines())
        rows.append(f"{round(1000 * s.start)}\t{round(1000 * s.end)}\t{text}\n")
    return "".join(rows)


def segment_to_dict(segment: Segment) -> dict[str, Any]:
    """A segment as openai-whisper's result dict has it (minus ``seek``, which we do not track);
    ``words`` only with word timestamps."""
    out = {
        "id": segment.id,
        "start": segment.start,
        "end": segment.end,
        "text": segment.text,  # raw, as decoded: the JSON is data, not display text
        "tokens": list(segment.tokens),
        "temperature": segment.temperature,
        "avg_logprob": segment.avg_logprob,
        "compression_ratio": segment.compression_ratio,
        "no_speech_prob": segment.no_speech_prob,
    }
    if segment.words is not None:
        out["words"] = [{"word": w.word, "start": w.start, "end": w.end, "probability": w.probability}
                        for w in segment.words]
    return out


def transcription_to_dict(t: Transcription) -> dict[str, Any]:
    """openai-whisper's ``transcribe()`` result dict, with ``duration`` added (OpenAI's verbose_json has it)."""
    return {
        "text": t.text,
        "segments": [segment_to_dict(s) for s in t.segments],
        "language": t.language,
        "duration": t.duration,
    }


def _render_json(t: Transcription, options: SubtitleOptions) -> str:
    # Default json.dumps settings (ASCII escapes, no indent) as openai-whisper's json.dump:
    # same bytes for the same result, and safe to embed anywhere.
    return json.dumps(transcription_to_dict(t))


# Each takes the subtitle options; only srt and vtt use them (as in openai-whisper).
_RENDERERS: dict[str, Callable[[Transcription, SubtitleOptions], str]] = {
    "txt": _render_txt,
    "vtt": _render_vtt,
    "srt": _render_srt,
    "tsv": _render_tsv,
    "json": _render_json,
}


def _unknown_format(fmt: str, allow_all: bool) -> ValueError:
    known = ", ".join(OUTPUT_FORMATS + ((ALL_FORMATS,) if allow_all else ()))
    return ValueError(f"unknown output format {fmt!r}; expected one of: {known}")


def render(t: Transcription, fmt: str, options: SubtitleOptions | None = None) -> str:
    """The text of ``t`` in one of ``OUTPUT_FORMATS`` (what the file of that format would hold).

    ``options`` lay out srt and vtt cues from word timestamps (ValueError when a segment has none);
    the other formats ignore them. OpenAI's API response formats map onto these: ``text`` -> ``txt``,
    ``srt``, ``vtt``, ``verbose_json`` -> ``json``; its plain ``json`` is just ``{"text": t.text}``.
    """
    renderer = _RENDERERS.get(fmt)
    if renderer is None:
        raise _unknown_format(fmt, allow_all=False)
    return renderer(t, options or SubtitleOptions())


def output_basename(audio_path: str | Path | None, t: Transcription | None = None) -> str:
    """The file name stem openai-whisper's CLI uses: the audio file's name without its extension.

    Without a path the transcript's ``source`` is used, then ``DEFAULT_BASENAME``.
    """
    source = audio_path if audio_path is not None else (t.source if t is not None else None)
    if source is None or not str(source):
        return DEFAULT_BASENAME
    # Like os.path.splitext: only the last extension goes ("a.b.wav" -> "a.b").
    return Path(source).stem or DEFAULT_BASENAME


def write_transcription(t: Transcription, fmt: str, output_dir: str | Path, audio_path: str | Path | None,
                        options: SubtitleOptions | None = None, stem: str | None = None) -> list[Path]:
    """Write ``t`` as ``<output_dir>/<audio basename>.<fmt>`` (UTF-8); ``fmt="all"`` writes every format.
    Each file is written atomically (``write_atomically``). ``stem`` replaces the audio basename when given.

    ``options`` shape the srt and vtt files (see ``render``). Creates ``output_dir`` if needed and
    returns the paths written, in ``OUTPUT_FORMATS`` order. Raises ValueError for an unknown format,
    or for options that need word timestamps ``t`` lacks, before anything is written.
    """
    if fmt == ALL_FORMATS:
        formats = OUTPUT_FORMATS
    elif fmt in _RENDERERS:
        formats = (fmt,)
    else:
        raise _unknown_format(fmt, allow_all=True)
    options = options or SubtitleOptions()
    if "srt" in formats or "vtt" in formats:
        check_words(t, options)
    out_dir = Path(output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = stem or output_basename(audio_path, t)
    texts = {out_dir / f"{stem}.{f}": render(t, f, options) for f in formats}  # every format renders first
    for path, text in texts.items():
        write_atomically(path, text)
    return list(texts)
