"""The flags of `encdec transcribe`: openai-whisper's (`whisper --help`), with its names, types and
defaults unless said otherwise, and the ones this engine adds. Each maps to a TranscribeOptions field,
an EngineConfig field, or the output step.

Where the defaults differ from openai-whisper's, on purpose: --model tiny.en (bundled; openai-whisper:
turbo), --beam-size 1 (HF generate's greedy; openai-whisper: 5), --verbose off (the transcript is printed
when each file is done; openai-whisper prints segments), --fp16 unset (--dtype decides).
"""

from __future__ import annotations

import argparse

from encdec_engine.cli.args import add_engine_args, optional_float, optional_int
from encdec_engine.checkpoints.names import DEFAULT_MODEL
from encdec_engine.speech.options import (APPEND_PUNCTUATIONS, PREPEND_PUNCTUATIONS, TranscribeOptions,
                                          fallback_temperatures)
from encdec_engine.speech.subtitles import SubtitleOptions

_FORMATS = ["txt", "vtt", "srt", "tsv", "json", "all"]


def add_transcribe_args(tr: argparse.ArgumentParser) -> None:
    tr.add_argument("audio", nargs="*", help="audio files (wav, flac, ogg, mp3, ...); on Ray also folders and globs")
    add_engine_args(tr, default_model=DEFAULT_MODEL)
    tr.add_argument("--fp16", action=argparse.BooleanOptionalAction, default=None,
                    help="openai-whisper's: float16 on CUDA; ignored with a warning on the CPU (default: unset, "
                         "--dtype decides)")
    out = tr.add_argument_group("output")
    out.add_argument("--output-dir", "-o", default=".", help="where <audio name>.<format> files are written")
    out.add_argument("--output-format", "-f", default="all", choices=_FORMATS,
                     help="the format of the files written; all: every one")
    out.add_argument("--verbose", action="store_true",
                     help="print each segment as its window is decoded, [start --> end] text, instead of each "
                          "file's transcript when it is done; also the model, device and threads at start-up")
    out.add_argument("--quiet", action="store_true", help="no progress bar and nothing on stdout, only the files")
    out.add_argument("--batch-size", type=int, default=16, help="files transcribed concurrently")

    dec = tr.add_argument_group("decoding")
    dec.add_argument("--language", default=None,
                     help="spoken language, a code (en) or name (English) (default: detect; English-only models: en)")
    dec.add_argument("--task", default="transcribe", choices=["transcribe", "translate"],
                     help="translate: X -> English (multilingual models)")
    dec.add_argument("--temperature", type=float, default=0.0,
                     help="the first temperature; failed windows are retried hotter (see the next flag)")
    dec.add_argument("--temperature-increment-on-fallback", type=optional_float, default=0.2,
                     help="temperatures tried: --temperature, then this much hotter each time up to 1.0; "
                          "none: only --temperature")
    dec.add_argument("--best-of", type=optional_int, default=5,
                     help="samples per window at a temperature above 0; none: 1")
    dec.add_argument("--beam-size", type=optional_int, default=1,
                     help="beams per window at temperature 0; 1 or none: greedy (openai-whisper's CLI uses 5)")
    dec.add_argument("--patience", type=float, default=None,
                     help="beam search patience (arXiv:2204.05424); only 1.0 runs, as the engine's beam search "
                          "is HF's (default: none, plain beam search; needs --beam-size 2 or more)")
    dec.add_argument("--length-penalty", type=float, default=None,
                     help="alpha in [0, 1]: rank candidates by log-probability / ((5 + length) / 6) ** alpha "
                          "(default: none, divide by the length)")
    dec.add_argument("--suppress-tokens", default="-1",
                     help="comma-separated token ids never decoded; -1: the checkpoint's list (non-speech symbols)")
    dec.add_argument("--prefix", default=None,
                     help="text the first window's transcript starts with (faster-whisper; default: none)")
    dec.add_argument("--hotwords", default=None,
                     help="hint phrases put before the previous text in every window's prompt (faster-whisper; "
                          "not with --prefix)")
    dec.add_argument("--prompt-reset-on-temperature", type=float, default=0.5,
                     help="a window kept above this temperature conditions no later window")
    dec.add_argument("--max-new-tokens", type=int, default=None,
                     help="tokens generated per window (default: the checkpoint's max_length)")
    dec.add_argument("--repetition-penalty", type=float, default=1.0,
                     help="above 1: tokens already in the window's text are less likely")
    dec.add_argument("--no-repeat-ngram-size", type=int, default=0,
                     help="no n-gram of this size repeats within a window (0: off)")
    dec.add_argument("--initial-prompt", default=None,
                     help="text that conditions the first window (default: none)")
    dec.add_argument("--carry-initial-prompt", action="store_true",
                     help="prepend --initial-prompt to every window's context, not only the first's")
    dec.add_argument("--condition-on-previous-text", action=argparse.BooleanOptionalAction, default=True,
                     help="each window sees the text before it; off: less prone to repetition loops")
    dec.add_argument("--compression-ratio-threshold", type=optional_float, default=2.4,
                     help="a window whose text compresses (zlib) better than this failed; none: never")
    dec.add_argument("--logprob-threshold", type=optional_float, default=-1.0,
                     help="a window whose mean token log-probability is below this failed; none: never")
    dec.add_argument("--no-speech-threshold", type=optional_float, default=0.6,
                     help="skip a window whose no-speech probability is above this and whose text is improbable "
                          "(below --logprob-threshold); none: never skip")
    dec.add_argument("--without-timestamps", action="store_true",
                     help="decode with <|notimestamps|> (one segment per window)")
    dec.add_argument("--clip-timestamps", default="",
                     help="seconds start,end[,start,end...] of the parts to transcribe; an odd count runs to the "
                          "end (default: the whole file)")
    dec.add_argument("--max-audio-seconds", type=float, default=None,
                     help="refuse a file longer than this, from its header before decoding (on Ray: default "
                          "4 hours, what one worker holds)")
    dec.add_argument("--chunked", action="store_true",
                     help="cut audio over 30 s at quiet points and decode the windows at once (faster; no window "
                          "sees an earlier one's text)")

    vad = tr.add_argument_group("voice activity detection (Silero VAD, faster-whisper's parameters)")
    vad.add_argument("--vad-filter", action="store_true",
                     help="Silero VAD first: decode only the speech (with --chunked: chunks of at most 30 s of "
                          "speech, at once); times stay on the audio's timeline")
    vad.add_argument("--vad-threshold", type=float, default=None,
                     help="speech probability at or above which a 32 ms frame is speech (default 0.5)")
    vad.add_argument("--vad-neg-threshold", type=float, default=None,
                     help="probability below which speech ends (default: threshold - 0.15)")
    vad.add_argument("--vad-min-speech-duration-ms", type=int, default=None,
                     help="drop speech shorter than this (default 0)")
    vad.add_argument("--vad-max-speech-duration-s", type=float, default=None,
                     help="split longer speech at its longest pause (default: no limit; with --chunked 30)")
    vad.add_argument("--vad-min-silence-duration-ms", type=int, default=None,
                     help="silence shorter than this does not end speech (default 2000; with --chunked and no "
                          "--vad-* flag 160)")
    vad.add_argument("--vad-speech-pad-ms", type=int, default=None,
                     help="audio kept on each side of the speech (default 400)")

    live = tr.add_argument_group("live transcription (text while it is spoken; --language, --initial-prompt and "
                                 "--vad-threshold, --vad-min-silence-duration-ms, --vad-speech-pad-ms apply)")
    live.add_argument("--live", metavar="SOURCE", default=None,
                      help="transcribe a live stream instead of files: '-' reads raw 16-bit mono PCM from stdin "
                           "(ffmpeg -f alsa -i default -f s16le -ac 1 -ar 16000 - | encdec transcribe --live -), "
                           "a file is played at real-time pace; confirmed text is printed as it comes")
    live.add_argument("--live-rate", type=int, default=16000, help="--live -: the PCM's sample rate (Hz)")
    live.add_argument("--live-speed", type=float, default=1.0,
                      help="--live FILE: playback speed (1: real time; 0: as fast as it is read)")
    live.add_argument("--turn-detection", choices=["server_vad", "none"], default="server_vad",
                      help="server_vad: a pause (--vad-min-silence-duration-ms, default 500) ends each turn; none: "
                           "one turn, ended with the stream")
    live.add_argument("--server", metavar="URL", default=None,
                      help="send the stream to a running `encdec serve` (its /v1/realtime) instead of loading a "
                           "model, e.g. http://127.0.0.1:8000")
    live.add_argument("--api-key", default=None,
                      help="--server: its API key (default: $ENCDEC_API_KEY, else $OPENAI_API_KEY; prefer those: "
                           "every user of the machine sees a flag in `ps`)")

    words = tr.add_argument_group("word timestamps")
    words.add_argument("--word-timestamps", action="store_true",
                       help="time each word (cross-attention alignment); JSON output lists them per segment")
    words.add_argument("--prepend-punctuations", default=PREPEND_PUNCTUATIONS,
                       help="with --word-timestamps: marks merged into the next word")
    words.add_argument("--append-punctuations", default=APPEND_PUNCTUATIONS,
                       help="with --word-timestamps: marks merged into the previous word")
    words.add_argument("--hallucination-silence-threshold", type=optional_float, default=None,
                       help="seconds: skip silence this long around a probable hallucination (default: none; "
                            "needs --word-timestamps)")
    words.add_argument("--highlight-words", action="store_true",
                       help="srt/vtt: one cue per word, the word underlined in its line (needs --word-timestamps)")
    words.add_argument("--max-line-width", type=optional_int, default=None,
                       help="srt/vtt: characters in a line before it breaks (default: none; needs --word-timestamps)")
    words.add_argument("--max-line-count", type=optional_int, default=None,
                       help="srt/vtt: lines per cue, cues then run across segments (default: none; needs "
                            "--max-line-width)")
    words.add_argument("--max-words-per-line", type=optional_int, default=None,
                       help="srt/vtt: words per cue, within a segment (default: none; needs --word-timestamps; "
                            "not with --max-line-width)")


def temperatures(args: argparse.Namespace) -> tuple[float, ...]:
    """The fallback schedule the flags ask for (speech/options.py's `fallback_temperatures`), its errors
    naming the flags."""
    start, step = args.temperature, args.temperature_increment_on_fallback
    if start < 0:
        raise ValueError(f"--temperature must be 0 or more, got {start}")
    if step is not None and step <= 0:
        raise ValueError(f"--temperature-increment-on-fallback must be above 0 (or none: no fallback), got {step}")
    return fallback_temperatures(start, step)


def transcribe_options(args: argparse.Namespace, temps: tuple[float, ...]) -> TranscribeOptions:
    """The TranscribeOptions the flags ask for (its validation names the field at fault)."""
    return TranscribeOptions(
        language=args.language, task=args.task, timestamps=not args.without_timestamps,
        initial_prompt=args.initial_prompt, carry_initial_prompt=args.carry_initial_prompt,
        condition_on_previous_text=args.condition_on_previous_text, temperatures=temps,
        compression_ratio_threshold=args.compression_ratio_threshold, logprob_threshold=args.logprob_threshold,
        no_speech_threshold=args.no_speech_threshold, beam_size=_or_one(args.beam_size), best_of=_or_one(args.best_of),
        patience=args.patience, length_penalty=args.length_penalty, suppress_tokens=args.suppress_tokens,
        word_timestamps=args.word_timestamps, prepend_punctuations=args.prepend_punctuations,
        append_punctuations=args.append_punctuations, clip_timestamps=args.clip_timestamps,
        hallucination_silence_threshold=args.hallucination_silence_threshold, chunked=args.chunked,
        prefix=args.prefix, hotwords=args.hotwords, prompt_reset_on_temperature=args.prompt_reset_on_temperature,
        max_new_tokens=args.max_new_tokens, repetition_penalty=args.repetition_penalty,
        no_repeat_ngram_size=args.no_repeat_ngram_size, max_audio_seconds=args.max_audio_seconds,
        **vad_options(args))


# --vad-* flag -> faster-whisper's vad_parameters name (speech/vad.py VadOptions)
VAD_FLAGS = {"vad_threshold": "threshold", "vad_neg_threshold": "neg_threshold",
             "vad_min_speech_duration_ms": "min_speech_duration_ms", "vad_max_speech_duration_s": "max_speech_duration_s",
             "vad_min_silence_duration_ms": "min_silence_duration_ms", "vad_speech_pad_ms": "speech_pad_ms"}


def vad_options(args: argparse.Namespace) -> dict:
    """--vad-filter and the --vad-* flags given as vad_filter and vad_parameters (flags left out keep
    faster-whisper's defaults); a --vad-* flag without --vad-filter would change nothing, so it is refused."""
    given = {name: getattr(args, flag) for flag, name in VAD_FLAGS.items() if getattr(args, flag) is not None}
    if given and not args.vad_filter:
        flags = ", ".join("--" + flag.replace("_", "-") for flag, name in VAD_FLAGS.items() if name in given)
        raise ValueError(f"{flags} {'needs' if len(given) == 1 else 'need'} --vad-filter")
    return {"vad_filter": args.vad_filter, "vad_parameters": given or None} if args.vad_filter else {}


def _or_one(value: int | None) -> int:
    return 1 if value is None else value  # openai-whisper's None: greedy, one sample


def subtitle_options(args: argparse.Namespace):
    """The srt/vtt layout flags as SubtitleOptions; like openai-whisper they need word timestamps, and
    flags that would change nothing are refused rather than ignored."""

    subtitles = SubtitleOptions(highlight_words=args.highlight_words, max_line_width=args.max_line_width,
                                max_line_count=args.max_line_count, max_words_per_line=args.max_words_per_line)
    names = subtitles.set_options
    flags = ", ".join("--" + name.replace("_", "-") for name in names)
    if flags and not args.word_timestamps:
        raise ValueError(f"{flags} {'needs' if len(names) == 1 else 'need'} --word-timestamps")
    if flags and args.output_format in ("txt", "tsv", "json"):
        raise ValueError(f"{flags} only shape srt and vtt files; add --output-format srt, vtt or all")
    return subtitles
