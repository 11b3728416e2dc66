"""The `encdec` command line: the parser of every subcommand, and running one.

Imports stay light until a command runs: torch and the engine load inside the commands (1.2 s), so
`--help` and argument errors answer at once. `transcribe` lives in transcribe.py (its flags in
transcribe_args.py), `translate` in translate.py, `serve` in serve.py, the `--ray` variants in ray.py, the
shared flags in args.py.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import sys
from contextlib import nullcontext
from typing import NoReturn

from encdec_engine import __version__
from encdec_engine.cli import args as args_module
from encdec_engine.cli.args import (HelpFormatter, Parser, add_engine_args, check_engine_args, error, load_llm,
                                   normalize_argv)
from encdec_engine.cli.transcribe import add_transcribe_parser
from encdec_engine.cli.ray import add_ray_args, ray_command, split_ray_address
from encdec_engine.distributed.cluster import RayNotInstalled
from encdec_engine.checkpoints.names import resolve
from encdec_engine.cli.serve import add_serve_parser
from encdec_engine.cli.translate import add_translate_parser
from encdec_engine.inputs.documents import MAX_DOCUMENT_BYTES, read_document
from encdec_engine.inputs.prompt_files import load_prompts_with_params
from encdec_engine.sampling_params import SamplingParams


def _llm(args):
    check_engine_args(args)
    return load_llm(args)


def cmd_generate(args) -> int:
    base = dict(temperature=args.temperature, max_tokens=args.max_tokens, top_p=args.top_p, top_k=args.top_k,
                seed=args.seed)
    entries = load_prompts_with_params(args.prompts, base)  # a bad line fails before the model loads
    if not entries:
        raise ValueError(f"{args.prompts}: no prompts (every line is blank)")
    params = [SamplingParams(**p) for _, p in entries]
    outs = _llm(args).generate([p for p, _ in entries], params, use_tqdm=not args.quiet)
    with open(args.output, "w") if args.output else nullcontext(sys.stdout) as sink:
        for out in outs:
            if out.error is not None:  # it failed alone; the others ran to the end
                print(f"error: prompt {out.request_id} failed: {out.error}", file=sys.stderr)
            sink.write(json.dumps(out.record()) + "\n")
    return 1 if any(out.error is not None for out in outs) else 0


def cmd_summarize(args) -> int:
    texts = []
    for name in args.files:
        try:
            texts.append(read_document(name, args.max_document_bytes))
        except ValueError as e:
            error(str(e))
            return 2
    overrides = {k: v for k, v in (("max_tokens", args.max_tokens), ("min_tokens", args.min_tokens)) if v is not None}
    summaries = _llm(args).summarize(texts, use_tqdm=not args.quiet, **overrides)
    for name, summary in zip(args.files, summaries):
        print(f"== {name}\n{summary}" if len(args.files) > 1 else summary)
    return 0


def cmd_download(args) -> int:
    """The model's folder on stdout, once it is on this machine (downloaded with a progress bar if not)."""
    print(resolve(args.name, args.model_dir))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="encdec", description="Serve encoder/decoder transformers.",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_transcribe_parser(sub, HelpFormatter)

    gen = sub.add_parser("generate", help="run a JSONL file of prompts (any prompt format)",
                         formatter_class=HelpFormatter)
    gen.add_argument("prompts", help="JSONL file: one prompt per line")
    add_engine_args(gen)
    gen.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=-1, help="sample from the k most likely tokens; -1: all")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (default: none, unseeded)")
    gen.add_argument("--output", help="write JSONL results here (default: stdout)")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    gen.set_defaults(func=cmd_generate)

    summ = sub.add_parser("summarize", help="summarize text files with the checkpoint's generation config",
                          formatter_class=HelpFormatter)
    summ.add_argument("files", nargs="*", help="text files, one summary each (on Ray also folders and globs)")
    add_engine_args(summ)
    summ.add_argument("--max-tokens", type=int, default=None,
                      help="summary tokens at most (default: the checkpoint's generation config)")
    summ.add_argument("--min-tokens", type=int, default=None,
                      help="summary tokens at least (default: the checkpoint's generation config)")
    summ.add_argument("--max-document-bytes", type=int, default=MAX_DOCUMENT_BYTES,
                      help="a file larger than this is refused before it is read")
    summ.add_argument("--quiet", action="store_true", help="no progress bar")
    summ.set_defaults(func=cmd_summarize)

    add_translate_parser(sub)
    add_serve_parser(sub)

    dl = sub.add_parser("download", help="fetch a model by name or hub id into the cache, for use offline",
                        formatter_class=HelpFormatter)
    dl.add_argument("name", help="a Whisper name (tiny ... large-v3, turbo, distil-*) or a hub id (org/name)")
    dl.add_argument("--model-dir", default=None, help="where a CTranslate2 model's import is kept (default: the cache)")
    dl.set_defaults(func=cmd_download)
    for command, command_parser in sub.choices.items():
        add_ray_args(command_parser, command)
    return parser


# Commands that are done once their output is written. The `encdec` program leaves right after them
# (`run`) instead of tearing the interpreter down: with torch loaded that teardown costs 0.3-0.5 s,
# a tenth of a one-file transcription. Ray jobs and the server exit the usual way.
ONE_SHOT_COMMANDS = ("transcribe", "summarize", "translate", "generate", "download")


def main(argv: list[str] | None = None) -> int:
    return _main(argv)[0]


def _main(argv: list[str] | None) -> tuple[int, bool]:
    """The command's exit code, and whether the process may leave without teardown."""
    parser = build_parser()
    args = parser.parse_args(split_ray_address(normalize_argv(parser, sys.argv[1:] if argv is None else argv)))
    on_ray = ray_command(args, parser)
    command = on_ray or args.func
    one_shot = on_ray is None and args.command in ONE_SHOT_COMMANDS
    if getattr(args, "verbose", False):  # the model, device, threads and KV pool as the engine starts
        logging.basicConfig(format="%(message)s")
        logging.getLogger("encdec_engine").setLevel(logging.INFO)
    try:
        return command(args), one_shot
    except (ValueError, OSError, RayNotInstalled) as e:  # bad arguments, unwritable outputs, no Ray: a message
        error(str(e))
        return 2, one_shot
    except KeyboardInterrupt:  # Ctrl-C before a command's own handling: one line, the shell's code for SIGINT
        print("interrupted", file=sys.stderr)
        return 130, one_shot


def run() -> NoReturn:
    """The `encdec` program: `main`, then, after a one-shot command, an exit without interpreter
    teardown (its files are closed by then; Python's and C's stdout and stderr and logging are
    flushed here). Under a profiler or a tracer (cProfile, coverage) it exits the usual way, so
    that they write their results."""
    args_module.FREEZE_LOADED = True  # the process ends with its command: what that loads is never garbage
    code, one_shot = _main(None)
    code = 0 if code is None else code
    if not one_shot or sys.getprofile() is not None or sys.gettrace() is not None:
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to tell it
            code = code or 1
    logging.shutdown()
    try:
        ctypes.CDLL(None).fflush(None)  # what native libraries printed through C's stdio
    except (OSError, AttributeError):  # no C library to ask (not POSIX)
        pass
    os._exit(code)


if __name__ == "__main__":
    run()
