"""The `encdec` commands on Ray: the flags `add_ray_args` gives transcribe, summarize, generate and serve,
and the commands `ray_command` runs instead of the single-machine ones when `--ray` or `--replicas` is set.

Importing this module imports neither Ray nor torch (the CLI builds its parser from it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Callable

from encdec_engine import distributed
from encdec_engine.checkpoints.names import DEFAULT_MODEL
from encdec_engine.cli.args import check_engine_args, command_parser, engine_kwargs, resolve_model
from encdec_engine.cli.serve import server_engine_kwargs, server_limits
from encdec_engine.cli.transcribe_args import subtitle_options, temperatures, transcribe_options
from encdec_engine.distributed.cluster import import_ray
from encdec_engine.speech.writers import render

JOB_COMMANDS = ("transcribe", "summarize", "generate")
# What `--ray ADDRESS` takes; anything else after a bare --ray is the command's next argument.
_ADDRESS = re.compile(r"^(auto|local|ray://\S+|[\w.\-]+:\d+|\[[0-9a-fA-F:]+\]:\d+)$")
# Flags that only mean something on Ray, with their defaults (set otherwise: refused without --ray).
_RAY_ONLY = {"num_workers": None, "threads_per_worker": 1, "results": None, "resume": False, "manifest": None,
             "job_batch_size": None}


def add_ray_args(parser: argparse.ArgumentParser, command: str) -> None:
    """Add the Ray flags of `command` (no-op for the commands that have none)."""
    if command not in (*JOB_COMMANDS, "serve"):
        return
    g = parser.add_argument_group("scale out on Ray (pip install 'encdec-engine[ray]')")
    g.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run on a Ray cluster: 'auto' (the one `ray start` runs here), HOST:PORT or "
                        "ray://HOST:10001; without ADDRESS a local cluster starts and stops with the command")
    workers = "replica" if command == "serve" else "worker"
    g.add_argument("--threads-per-worker", type=int, default=1,
                   help=f"torch threads (and Ray CPUs) of each {workers}'s engine")
    if command == "serve":
        g.add_argument("--replicas", type=int, default=None,
                       help="engine replicas behind the same routes, on Ray Serve (implies --ray)")
        return
    g.add_argument("--num-workers", type=int, default=None,
                   help="engines in the actor pool, one model each (default: as many as the cluster's CPUs hold)")
    if command != "transcribe":  # transcribe's own --batch-size is the worker batch on Ray
        g.add_argument("--batch-size", dest="job_batch_size", type=int, default=None,
                       help="inputs per worker batch, run through the engine at once (default 16; generate 64)")
    if command != "generate":  # generate's prompt file is its manifest
        g.add_argument("--manifest", default=None, metavar="FILE",
                       help="JSONL of inputs: " + ('{"audio": PATH, "id": ..., "output": NAME}' if command ==
                                                   "transcribe" else '{"text": ..., "id": ...} or {"path": PATH}'))
    g.add_argument("--results", default=None, metavar="FILE",
                   help="JSONL with one row per input, written as rows arrive (transcribe: default "
                        "<output-dir>/results.jsonl when files are written; generate: default --output)")
    g.add_argument("--resume", action="store_true",
                   help="skip inputs whose row in the results file and output files are complete")


def split_ray_address(argv: list[str]) -> list[str]:
    """`--ray` takes an address only when the next argument is one: `--ray a.wav` runs a.wav on a local
    cluster, `--ray auto a.wav` on the cluster at 'auto'."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--ray" and (i + 1 == len(out) or not _ADDRESS.match(out[i + 1])):
            out[i] = "--ray="
    return out


def ray_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Callable | None:
    """The Ray version of the command when `--ray` / `--replicas` asks for it, else None (after
    refusing Ray-only flags); inputs are required either way."""
    parser = command_parser(parser, args.command)  # its errors name the subcommand
    on_ray = getattr(args, "ray", None) is not None or getattr(args, "replicas", None) is not None
    if not on_ray:
        for name, default in _RAY_ONLY.items():
            if getattr(args, name, default) != default:
                flag = "--batch-size" if name == "job_batch_size" else "--" + name.replace("_", "-")
                parser.error(f"{flag} needs --ray")
    inputs = {"transcribe": "audio", "summarize": "files"}.get(args.command)
    live = getattr(args, "live", None) is not None or getattr(args, "server", None) is not None  # one stream, no files
    if live and on_ray:
        parser.error("--live transcribes one stream here; leave out --ray and --replicas")
    if inputs and not live and not getattr(args, inputs) and getattr(args, "manifest", None) is None:
        parser.error(f"the following arguments are required: {inputs}" + (" (or --manifest)" if on_ray else ""))
    if not on_ray:
        return None

    def run(args: argparse.Namespace) -> int:
        import_ray()  # RayNotInstalled before anything (a results file, a model import) is written
        return command(args)

    command = {"transcribe": _transcribe, "summarize": _summarize, "generate": _generate, "serve": _serve}[args.command]
    return run


def _cluster_kwargs(args: argparse.Namespace) -> dict:
    return dict(address=args.ray or None, num_workers=args.num_workers, threads_per_worker=args.threads_per_worker,
                results=args.results, resume=args.resume)


def _model(args: argparse.Namespace) -> str | None:
    """None for the default model (every worker finds its own copy), else the folder `--model` names here."""

    check_engine_args(args)
    return None if args.model in (None, DEFAULT_MODEL) else resolve_model(args)


def _engine(args: argparse.Namespace, engine: dict | None = None) -> dict:
    """The engine fields of the flags; each worker's torch threads are --threads-per-worker's."""

    engine = dict(engine if engine is not None else engine_kwargs(args))
    if engine.get("threads") not in (None, args.threads_per_worker):
        raise ValueError("on Ray, --threads-per-worker sets each engine's threads: leave --threads out")
    engine["threads"] = args.threads_per_worker
    return engine


def _transcribe(args: argparse.Namespace) -> int:
    from encdec_engine.distributed.api import MAX_AUDIO_SECONDS, transcription_from_row  # lazy: tqdm (30 ms)

    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
    options = dataclasses.asdict(transcribe_options(args, temperatures(args)))
    language, task = options.pop("language"), options.pop("task")
    if options["max_audio_seconds"] is None:  # not given: what one worker may hold
        options["max_audio_seconds"] = MAX_AUDIO_SECONDS
    writes = bool(args.output_dir or args.output_format)
    rows = distributed.transcribe(args.audio, _model(args), manifest=args.manifest, output_dir=args.output_dir,
                                  output_format=args.output_format, subtitles=subtitle_options(args),
                                  language=language, task=task, batch_size=args.batch_size,
                                  engine=_engine(args), progress=not args.quiet, stream=True,
                                  **_cluster_kwargs(args), **options)

    def show(row: dict) -> None:
        if row["error"] is None and (not args.quiet or not writes):
            print(f"== {row['path']}\n{render(transcription_from_row(row), 'vtt' if args.verbose else 'txt')}", end="")

    return _report(rows, show)


def _summarize(args: argparse.Namespace) -> int:
    overrides = {k: v for k, v in (("max_tokens", args.max_tokens), ("min_tokens", args.min_tokens)) if v is not None}
    rows = distributed.summarize(args.files, _model(args), manifest=args.manifest,
                                 batch_size=args.job_batch_size or 16, engine=_engine(args),
                                 progress=not args.quiet, stream=True, max_document_bytes=args.max_document_bytes,
                                 **_cluster_kwargs(args), **overrides)
    return _report(rows, lambda row: row["error"] is None and print(f"== {row['path'] or row['id']}\n{row['text']}"))


def _generate(args: argparse.Namespace) -> int:
    params = dict(temperature=args.temperature, max_tokens=args.max_tokens, top_p=args.top_p, top_k=args.top_k,
                  seed=args.seed)
    cluster = {**_cluster_kwargs(args), "results": args.results or args.output}
    rows = distributed.generate(args.prompts, _model(args), batch_size=args.job_batch_size or 64,
                                engine=_engine(args), progress=not args.quiet, stream=True, **cluster, **params)
    # As `encdec generate` without --output: the records on stdout.
    show = (lambda row: None) if cluster["results"] else (lambda row: print(json.dumps(row)))
    return _report(rows, show, what=lambda row: f"prompt {row['id']} failed: ")


def _report(rows, show: Callable[[dict], object], what: Callable[[dict], str] = lambda row: "") -> int:
    """Show each row as it arrives and each error on stderr; the exit status: 1 when an input failed."""
    failed = 0
    for row in rows:
        if row["error"] is not None:
            failed += 1
            print(f"error: {what(row)}{row['error']}", file=sys.stderr)
        show(row)
    return 1 if failed else 0


def _serve(args: argparse.Namespace) -> int:
    server = distributed.serve(_model(args), replicas=args.replicas or 1, address=args.ray or None,
                               threads_per_replica=args.threads_per_worker, host=args.host, port=args.port,
                               limits=server_limits(args), served_model_name=args.served_model_name,
                               shutdown_timeout=args.shutdown_timeout, log_level=args.log_level,
                               engine=_engine(args, server_engine_kwargs(args)))
    print(f"serving {server.replicas} replicas on {server.url} (Ctrl+C stops)", file=sys.stderr, flush=True)
    server.wait()
    return 0
