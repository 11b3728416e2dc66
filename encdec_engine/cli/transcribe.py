"""`encdec transcribe`: openai-whisper's command line on the engine.

Everything that can be checked without the model is checked first (flags, files, language, output
folder), so a mistake costs no model load. Then each file's outputs are written the moment it is done,
atomically, and Ctrl-C stops cleanly: exit 130, every finished file on disk, no partial one.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path

from encdec_engine.checkpoints.names import is_english_only
from encdec_engine.cli.args import check_engine_args, error, load_llm, loading, make_output_dir, resolve_model
from encdec_engine.cli.live import cmd_live
from encdec_engine.speech.subtitles import SubtitleOptions
from encdec_engine.cli.transcribe_args import (add_transcribe_args, subtitle_options, temperatures,
                                                       transcribe_options)
from encdec_engine.speech.writers import format_timestamp, output_basename, render, write_transcription
from encdec_engine.speech.options import TranscribeOptions
from encdec_engine.speech.results import Segment


@dataclass
class TranscribePlan:
    """What a transcribe command will do, checked before the model loads."""

    files: list[str]  # readable files, in the order given
    bad: dict[str, str]  # file -> why it cannot be read (reported at once, exit 1 at the end)
    options: TranscribeOptions
    output_dir: Path
    output_format: str
    subtitles: SubtitleOptions  # the srt/vtt cue layout


def add_transcribe_parser(sub, formatter) -> None:
    tr = sub.add_parser("transcribe", help="transcribe audio files with Whisper (openai-whisper's flags)",
                        formatter_class=formatter,
                        description="Transcribe audio files. Every flag also takes openai-whisper's spelling "
                                    "(--output_dir, --word_timestamps True, --condition_on_previous_text False).")
    add_transcribe_args(tr)
    tr.set_defaults(func=cmd_transcribe)


def plan_transcription(args: argparse.Namespace) -> TranscribePlan:
    """Every check that needs no model: ValueError naming the flag or file at fault."""
    check_engine_args(args)
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.verbose and args.quiet:
        raise ValueError("--verbose prints segments and --quiet prints nothing: give one of them")
    if args.fp16 is not None and args.dtype not in ("auto", "float16" if args.fp16 else "float32"):
        raise ValueError(f"--fp16 {args.fp16} and --dtype {args.dtype} disagree; give one of them")
    options = transcribe_options(args, temperatures(args))
    files, bad = [], {}
    for path in args.audio:
        problem = unreadable(path)
        if problem is None:
            files.append(path)
        else:
            bad[path] = problem
    out_dir = Path(args.output_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--output-dir {out_dir} exists and is not a directory")
    stems: dict[str, str] = {}
    for path in files:
        other = stems.setdefault(output_basename(path), path)
        if other != path:
            raise ValueError(f"{other} and {path} would both be written as {output_basename(path)}.*; "
                             "transcribe them into different --output-dir folders")
    return TranscribePlan(files, bad, options, out_dir, args.output_format, subtitle_options(args))


def unreadable(path: str) -> str | None:
    """Why an audio path cannot be read, or None: from the file system and the file's first bytes (a text
    file, a playlist), not from decoding it: a file corrupt past its header fails while it is transcribed."""
    if not os.path.exists(path):
        return f"{path}: no such file"
    if os.path.isdir(path):
        return f"{path}: is a directory, not an audio file"
    if not os.access(path, os.R_OK):
        return f"{path}: not readable (permission denied)"
    if os.path.getsize(path) == 0:
        return f"{path}: the file is empty (0 bytes)"
    from encdec_engine.inputs.audio import format_problem  # lazy: numpy and libsndfile, once a file is given

    return format_problem(path)


def check_language_for_model(args: argparse.Namespace, model_path: str | None, language: str | None,
                             task: str) -> None:
    """An English-only checkpoint refuses other languages and translation before it loads: from its name
    alone (a `.en` name, checked before the model is even looked for), else from its folder's config."""
    if not is_english_only(args.model, None if model_path is None else Path(model_path)):
        return
    if language is not None and language != "en":
        raise ValueError(f"{args.model} is English-only: it cannot transcribe language {language!r}; use a "
                         "multilingual model (tiny, base, small, ...) or leave out --language")
    if task == "translate":
        raise ValueError(f"{args.model} is English-only: it cannot translate; use a multilingual model")


def transcribe_dtype(args: argparse.Namespace) -> str:
    """openai-whisper's --fp16: float16 on CUDA; on the CPU it is ignored with a warning, as there."""
    if args.fp16 is None:
        return args.dtype
    if not args.fp16:
        return "float32"
    import torch

    if args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available()):
        return "float16"
    print("warning: --fp16 is not supported on the CPU; using float32 instead", file=sys.stderr)
    return "float32"


@contextmanager
def interrupts_deferred():
    """Ctrl-C waits for the block to end (all of a file's outputs are written, or none), then raises.
    Only where Ctrl-C raises KeyboardInterrupt at all: the main thread, Python's own SIGINT handler."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt


def segment_line(segment: Segment, source: str | None) -> str:
    """openai-whisper's verbose line; with several files at once, the file's name first."""
    line = f"[{format_timestamp(segment.start)} --> {format_timestamp(segment.end)}] {segment.text}"
    return f"{source}: {line}" if source else line


def _say(tqdm, text: str, file=None) -> None:
    """A line on stdout (or `file`) now, even into a pipe, on a line of its own: tqdm clears the progress bar
    on stderr first (the bar's line ends in no newline) and draws it again after."""
    file = file or sys.stdout
    tqdm.write(text, file=file)
    file.flush()


def cmd_transcribe(args: argparse.Namespace) -> int:
    if args.live is not None or args.server is not None:
        return cmd_live(args)
    plan = plan_transcription(args)
    for problem in plan.bad.values():  # up front; the readable files still run
        error(problem)
    if not plan.files:
        error(f"no readable audio file among {len(args.audio)}")
        return 1
    check_language_for_model(args, None, plan.options.language, plan.options.task)  # a .en name: before anything
    with loading():  # resolving the model may import torch already
        model = resolve_model(args)
        check_language_for_model(args, model, plan.options.language, plan.options.task)
        make_output_dir(plan.output_dir)
        llm = load_llm(args, model, dtype=transcribe_dtype(args))  # after the files were checked
    from tqdm.auto import tqdm

    from encdec_engine.speech.offline import stream_transcriptions  # lazy: imported with the engine

    logging.getLogger(__name__).info("%s", llm.engine.describe())
    failed, written = dict(plan.bad), 0
    several = len(plan.files) > 1
    stream = stream_transcriptions(llm.engine, plan.options, plan.files, use_tqdm=not args.quiet,
                                   max_in_flight=args.batch_size)
    try:
        with closing(stream):
            for update in stream:
                path = plan.files[update.index]
                if args.verbose:
                    for seg in update.segments:
                        _say(tqdm, segment_line(seg, path if several else None))
                result = update.transcription
                if result is None:
                    continue
                if result.error is not None:
                    failed[path] = result.error
                    _say(tqdm, f"error: {result.error}", sys.stderr)  # as `error` writes it, below the bar
                    continue
                with interrupts_deferred():  # a Ctrl-C here is raised after the count: the file is whole
                    write_transcription(result, plan.output_format, plan.output_dir, path, plan.subtitles)
                    written += 1
                text = render(result, "txt")
                if not args.quiet and not args.verbose and (text or several):
                    _say(tqdm, (f"== {path}\n" if several else "") + text.rstrip("\n"))
    except KeyboardInterrupt:
        print(f"interrupted: {written} of {len(plan.files)} files finished, their outputs written to "
              f"{plan.output_dir}; nothing of the others was written", file=sys.stderr)
        return 130
    if failed:
        error(f"{len(failed)} of {len(args.audio)} files failed: {', '.join(failed)}")
        return 1
    return 0
