"""ffmpeg for the containers libsndfile cannot read (m4a, webm, wma, ...), reading only the file it is given.

Left to itself ffmpeg guesses a file's format from its content, and some formats it would guess are
scripts that name other files or URLs: an uploaded text file `ffconcat version 1.0\\nfile a.wav`
called `x.m4a` makes it decode `a.wav` from the server's disk. So the demuxer is chosen here, from
the file's first bytes, among containers that hold their own audio (`sniff`); playlists and anything
unrecognised are refused, naming what was found. ffmpeg and ffprobe then run with that demuxer and
`-protocol_whitelist file`, so not even a chosen demuxer can open a network stream, and errors name
the caller's file name, never the path of a temporary file.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass

import numpy as np

# (demuxer, what users call it, does the file's start match)
_CONTAINERS: tuple[tuple[str, str, object], ...] = (
    ("wav", "WAV", lambda h: h[:4] in (b"RIFF", b"RF64") and h[8:12] == b"WAVE"),
    ("avi", "AVI", lambda h: h[:4] == b"RIFF" and h[8:12] == b"AVI "),
    ("flac", "FLAC", lambda h: h[:4] == b"fLaC"),
    ("ogg", "Ogg", lambda h: h[:4] == b"OggS"),
    ("mov", "MP4/M4A/MOV", lambda h: h[4:8] in (b"ftyp", b"moov", b"mdat", b"wide", b"free", b"skip")),
    ("matroska", "WebM/Matroska", lambda h: h[:4] == b"\x1a\x45\xdf\xa3"),
    ("asf", "WMA/ASF", lambda h: h[:8] == b"\x30\x26\xb2\x75\x8e\x66\xcf\x11"),
    ("aiff", "AIFF", lambda h: h[:4] == b"FORM" and h[8:12] in (b"AIFF", b"AIFC")),
    ("caf", "CAF", lambda h: h[:4] == b"caff"),
    ("amr", "AMR", lambda h: h[:5] == b"#!AMR"),
    ("wv", "WavPack", lambda h: h[:4] == b"wvpk"),
    ("au", "Sun AU", lambda h: h[:4] == b".snd"),
    ("mp3", "MP3", lambda h: h[:3] == b"ID3" or (h[:1] == b"\xff" and len(h) > 1 and h[1] & 0xE6 in (0xE2, 0xE4, 0xE6))),
    ("aac", "AAC (ADTS)", lambda h: h[:1] == b"\xff" and len(h) > 1 and h[1] & 0xF6 == 0xF0),
    ("ac3", "AC-3", lambda h: h[:2] == b"\x0b\x77"),
)
# Text formats that point at other files or URLs: named in the refusal.
_PLAYLISTS = ((b"ffconcat", "an ffconcat playlist"), (b"#EXTM3U", "an M3U/HLS playlist"),
              (b"[playlist]", "a PLS playlist"), (b"<?xml", "an XML document (a playlist or manifest)"),
              (b"<smil", "a SMIL playlist"), (b"#EXT", "an M3U playlist"), (b"file ", "a concat list"))
HEADER_BYTES = 16


class FormatError(ValueError):
    """The file is not a container this module decodes; the message says what it looks like."""


def sniff(head: bytes, name: str) -> str:
    """The ffmpeg demuxer for a file starting with `head` (at least `HEADER_BYTES`); FormatError naming
    `name` for a playlist or anything unrecognised."""
    for demuxer, _, matches in _CONTAINERS:
        if matches(head):
            return demuxer
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    for start, what in _PLAYLISTS:
        if text[: len(start)].lower() == start.lower():
            raise FormatError(f"{name} is {what}, not audio: files that refer to other files or URLs are refused")
    known = ", ".join(label for _, label, _ in _CONTAINERS)
    raise FormatError(f"{name} is not in an audio format this engine decodes ({known})")


def sniff_file(path: str, name: str) -> str:
    with open(path, "rb") as f:
        return sniff(f.read(HEADER_BYTES), name)


def _tool(tool: str) -> str:
    found = shutil.which(tool)
    if found is None:
        raise FileNotFoundError(f"{tool} is not installed; it decodes m4a, webm, wma and other containers "
                                "(Debian/Ubuntu: apt install ffmpeg)")
    return found


def _inputs(path: str, demuxer: str) -> list[str]:
    # -f: no guessing; the whitelist: the demuxer may open this file and nothing else (no http, no pipes).
    return ["-protocol_whitelist", "file", "-f", demuxer, "-i", f"file:{path}"]


@dataclass(frozen=True)
class StreamInfo:
    """What the container says of its first audio stream (None where it says nothing)."""

    demuxer: str
    seconds: float | None
    sample_rate: int | None
    channels: int | None


def probe(path: str, name: str) -> StreamInfo:
    """The first audio stream's length, rate and channels from the container alone. FormatError for
    what `sniff` refuses, or what ffprobe cannot read."""
    demuxer = sniff_file(path, name)
    command = [_tool("ffprobe"), "-v", "error", *_inputs(path, demuxer), "-select_streams", "a:0",
               "-show_entries", "stream=sample_rate,channels,duration:format=duration", "-of", "json"]
    done = subprocess.run(command, capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise FormatError(f"cannot decode {name} ({demuxer}: corrupt or truncated)")
    info = json.loads(done.stdout or b"{}")
    streams = info.get("streams") or []
    if not streams:
        raise FormatError(f"{name} has no audio stream")
    stream = streams[0]
    seconds = _number(stream.get("duration")) or _number(info.get("format", {}).get("duration"))
    rate, channels = _number(stream.get("sample_rate")), _number(stream.get("channels"))
    return StreamInfo(demuxer, seconds, int(rate) if rate else None, int(channels) if channels else None)


def decode(path: str, name: str, max_seconds: float | None = None,
           info: StreamInfo | None = None) -> tuple[np.ndarray, int]:
    """The first audio stream as int16 PCM ``[num_samples, channels]`` at its own rate, as ffmpeg's
    decoder gives it, and that rate (at most `max_seconds` + 0.1 s: decoding stops there). FormatError
    when `sniff` refuses the file or ffmpeg cannot decode it. `info`: the file's `probe`, if made."""
    info = info or probe(path, name)
    if not info.sample_rate or not info.channels:
        raise FormatError(f"{name}: its audio stream states no sample rate or channel count")
    limit = [] if max_seconds is None else ["-t", f"{max_seconds + 0.1:.3f}"]
    command = [_tool("ffmpeg"), "-nostdin", "-v", "error", *_inputs(path, info.demuxer), "-map", "0:a:0", "-vn",
               *limit, "-f", "s16le", "-acodec", "pcm_s16le", "-ac", str(info.channels),
               "-ar", str(info.sample_rate), "pipe:1"]
    done = subprocess.run(command, capture_output=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise FormatError(f"cannot decode {name} ({info.demuxer}: corrupt or unsupported codec)")
    samples = np.frombuffer(done.stdout, dtype="<i2")
    samples = samples[: len(samples) - len(samples) % info.channels]
    return samples.reshape(-1, info.channels), info.sample_rate


def _number(value) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if number > 0 else None
