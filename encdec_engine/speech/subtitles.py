"""Subtitle cues for srt and vtt, laid out from word timestamps the way openai-whisper's CLI does it.

openai-whisper's ``--highlight_words``, ``--max_line_width``, ``--max_line_count`` and
``--max_words_per_line`` (``SubtitlesWriter.iterate_result`` in ``whisper/utils.py``) become
``SubtitleOptions``. Without any of them a cue is a segment: its times, its stripped text (today's
output). With one, cues are built from ``Segment.words``:

- Lines fill greedily: a word joins the line while ``len(line) + len(word with its leading space)
  <= max_line_width``; otherwise it starts the next line (stripped, after a "\\n").
- Without ``max_line_count`` every segment starts a new cue, and so does every run of
  ``max_words_per_line`` words within it (the line breaks above still apply).
- With ``max_line_count`` cues flow across segments: a cue ends when a line would exceed the count,
  or before a word that starts more than ``LONG_PAUSE`` after the previous word started.
- ``highlight_words`` turns each cue into one cue per word, the word underlined (``<u>word</u>``)
  in the cue's text, plus a cue of the plain text for each gap between one word's end and the
  next word's start (at millisecond resolution).

A cue runs from its first word's start to its last word's end. Differences from openai-whisper, on
purpose: a segment whose words are ``[]`` (the engine could not align it) keeps its text as one cue
over the segment's times, wrapped at ``max_line_width`` but never split or highlighted, where
openai-whisper drops its text; a gap cue is written only when the gap is positive (overlapping
words would give a cue that ends before it starts); "-->" in word text becomes "->" as in
segment text.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields, replace

from encdec_engine.speech.results import Segment, Transcription, Word

LONG_PAUSE = 3.0  # seconds between two word starts that end a flowing cue (openai-whisper's rule)
NO_LINE_WIDTH = 1000  # characters: the line width openai-whisper uses when none is given


@dataclass(frozen=True)
class SubtitleOptions:
    """How srt and vtt lay out cues (openai-whisper's word options); the defaults give one cue per segment.

    Every option other than the defaults needs word timestamps (``Segment.words``).
    """

    highlight_words: bool = False  # one cue per word, the word underlined within its cue's text
    max_line_width: int | None = None  # characters per line before a line break
    max_line_count: int | None = None  # lines per cue; cues then flow across segments (needs max_line_width)
    max_words_per_line: int | None = None  # words per cue within a segment (not with max_line_width)

    def __post_init__(self) -> None:
        for name in ("max_line_width", "max_line_count", "max_words_per_line"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        # openai-whisper only warns that these combinations have no effect; refusing says so at once.
        if self.max_line_count is not None and self.max_line_width is None:
            raise ValueError("max_line_count needs max_line_width (lines only break at a width)")
        if self.max_words_per_line is not None and self.max_line_width is not None:
            raise ValueError("max_words_per_line and max_line_width exclude each other "
                             "(openai-whisper: max_words_per_line has no effect with max_line_width)")

    @property
    def set_options(self) -> list[str]:
        """The names of the options that differ from their defaults (each needs word timestamps)."""
        return [f.name for f in fields(self) if getattr(self, f.name) != f.default]


@dataclass(frozen=True)
class Cue:
    """One subtitle: shown from ``start`` to ``end`` (seconds); ``text`` has "\\n" between lines."""

    start: float
    end: float
    text: str


def subtitle_cues(t: Transcription, options: SubtitleOptions | None = None) -> list[Cue]:
    """The cues of ``t`` for srt and vtt. Raises ValueError when an option is set and a segment has no
    word timestamps (``words is None``)."""
    options = options or SubtitleOptions()
    if not options.set_options:
        return [Cue(s.start, s.end, _defuse(s.text.strip())) for s in t.segments]
    check_words(t, options)
    cues: list[Cue] = []
    for group in _layout(t.segments, options):
        if isinstance(group, Cue):  # an unaligned segment, as it is
            cues.append(group)
        elif options.highlight_words:
            cues.extend(_highlighted(group))
        else:
            cues.append(Cue(group[0].start, group[-1].end, _defuse("".join(w.word for w in group))))
    return cues


def check_words(t: Transcription, options: SubtitleOptions) -> None:
    """Raise ValueError when ``options`` need word timestamps and a segment of ``t`` has none."""
    names = options.set_options
    missing = next((s for s in t.segments if s.words is None), None)
    if names and missing is not None:
        raise ValueError(f"{', '.join(names)} {'needs' if len(names) == 1 else 'need'} word timestamps, but "
                         f"segment {missing.id} has none (transcribe with word_timestamps=True)")


def _layout(segments: list[Segment], options: SubtitleOptions) -> Iterator[list[Word] | Cue]:
    """openai-whisper's cue builder: yields each cue as its words, each word's text as it reads in the
    cue (leading space kept within a line; stripped, with "\\n" before it, when it starts a later line).
    A segment without words is yielded as its finished Cue."""
    width = options.max_line_width or NO_LINE_WIDTH
    max_lines = options.max_line_count
    flowing = max_lines is not None  # cues may span segments (openai-whisper: not preserve_segments)
    per_cue = options.max_words_per_line
    cue: list[Word] = []
    line_len, line_count = 0, 1  # characters in the current line; lines in the current cue
    last_start = next((w.start for s in segments for w in s.words or ()), 0.0)
    for segment in segments:
        if not segment.words:
            if cue:
                yield cue
            cue, line_len, line_count = [], 0, 1
            text = _wrap(segment.text, options.max_line_width)
            if text:
                yield Cue(segment.start, segment.end, _defuse(text))
            continue
        for i, word in enumerate(segment.words):
            long_pause = flowing and word.start - last_start > LONG_PAUSE
            # Each segment, and each run of per_cue words in it, starts a cue unless cues flow.
            starts_cue = not flowing and bool(cue) and i % (per_cue or len(segment.words)) == 0
            if line_len > 0 and line_len + len(word.word) <= width and not long_pause and not starts_cue:
                text = word.word
                line_len += len(text)
            else:
                text = word.word.strip()
                if starts_cue or (cue and flowing and (long_pause or line_count >= max_lines)):
                    yield cue
                    cue, line_count = [], 1
                elif line_len > 0:
                    line_count += 1
                    text = "\n" + text
                line_len = len(text.strip())
            cue.append(replace(word, word=text))
            last_start = word.start
    if cue:
        yield cue


def _highlighted(words: list[Word]) -> Iterator[Cue]:
    """One cue per word with that word underlined, and a plain cue over each gap between words."""
    plain = _defuse("".join(w.word for w in words))
    shown_until = words[0].start  # seconds: the end of the last cue written
    for i, word in enumerate(words):
        if _ms(shown_until) < _ms(word.start):
            yield Cue(shown_until, word.start, plain)
        text = "".join(_underline(w.word) if j == i else w.word for j, w in enumerate(words))
        yield Cue(word.start, word.end, _defuse(text))
        shown_until = word.end


def _underline(text: str) -> str:
    # Leading whitespace (a space, or the "\n" of a line break) stays outside the tags.
    body = text.lstrip()
    return f"{text[:len(text) - len(body)]}<u>{body}</u>"


def _wrap(text: str, width: int | None) -> str:
    """``text`` stripped, broken into lines at spaces by the same rule as words (no limit without a width)."""
    if width is None:
        return text.strip()
    lines: list[str] = []
    for word in text.split():
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return "\n".join(lines)


def _ms(seconds: float) -> int:
    return round(seconds * 1000.0)  # what format_timestamp shows


def _defuse(text: str) -> str:
    # "-->" inside cue text would read as a timing line to SRT/VTT parsers, and a blank line ends a cue.
    lines = (line.strip() for line in text.replace("-->", "->").splitlines())
    return "\n".join(line for line in lines if line)
