"""Argument plumbing shared by the `encdec` commands: value types, the help layout, openai-whisper's
spellings, and the engine options every command takes.

Nothing here imports torch or the engine until `load_llm` runs: `encdec --help` and argument errors stay
instant.

openai-whisper's CLI spells flags with underscores and gives booleans a value (`--word_timestamps
True`). Both are accepted: `normalize_argv` rewrites `--word_timestamps True` to `--word-timestamps`
and `--condition_on_previous_text False` to `--no-condition-on-previous-text` before argparse runs.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from encdec_engine.checkpoints.names import first_import, resolve
from encdec_engine.compute_types import COMPUTE_TYPES, FLAGS, fold_compute_type

_TRUE, _FALSE = ("true", "yes", "1"), ("false", "no", "0")

# Set by the `encdec` program (main.run), not by `main()` called in a process that goes on: what
# `loading` loaded then stays out of every later garbage collection (gc.freeze).
FREEZE_LOADED = False


def str2bool(value: str) -> bool:
    """openai-whisper's True/False (any case; yes/no and 1/0 too)."""
    if value.lower() in _TRUE + _FALSE:
        return value.lower() in _TRUE
    raise argparse.ArgumentTypeError(f"expected True or False, got {value!r}")


def optional_float(value: str) -> float | None:
    """A number, or none / None (openai-whisper's spelling) for "off"."""
    return None if value.lower() == "none" else float(value)


def optional_int(value: str) -> int | None:
    return None if value.lower() == "none" else int(value)


def comma_list(value: str) -> tuple[str, ...]:
    """`a, b,c` -> ("a", "b", "c")."""
    return tuple(item.strip() for item in value.split(",") if item.strip())


def api_key(flag: str | None, *env: str) -> str | None:
    """An API key: --api-key's, with a warning (every user of this machine can read a command line, in `ps`
    or /proc), else the first of the environment variables `env` that is set."""
    if flag:
        warn("--api-key shows the key to every user of this machine (ps, /proc/PID/cmdline); set it in the "
             f"environment instead: {env[0]}=... (the flag still works)")
        return flag
    return next((os.environ[name] for name in env if os.environ.get(name)), None)


class Parser(argparse.ArgumentParser):
    """A refused argument is one line naming it and where the usage is (`encdec transcribe -f docx`
    used to print the whole 50-line usage above the error)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        """argparse's, but arguments no parser took are refused by the subcommand's parser, so the message
        names `encdec transcribe`, not `encdec`."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command_parser(self, getattr(parsed, "command", None)).error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in its help: "(default: X)" unless the help says it already; a default
    of None or False is written out in the help text itself, where it needs words ("detect")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default is argparse.SUPPRESS
        if "default" in text or unset or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


def make_output_dir(path: str | Path) -> None:
    """Create the `--output-dir` folder (and its parents); one that cannot be made is a ValueError naming
    the flag and the folder (it was a bare "[Errno 2] No such file or directory")."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--output-dir {path}: cannot create it ({e.strerror or e})") from None


def command_parser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    """The parser of subcommand `command` (whose errors name `encdec transcribe`), else `parser` itself."""
    return _subparser(parser, [command] if command else []) or parser


def _subparser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser | None:
    command = next((a for a in argv if not a.startswith("-")), None)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(command)
    return None


def normalize_argv(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """openai-whisper's spellings -> ours: `--output_dir` -> `--output-dir` (any flag), and a boolean
    flag with a value (`--fp16 False`, `--verbose=True`) -> the bare flag or its `--no-` form."""
    sub = _subparser(parser, argv)
    if sub is None:
        return argv
    actions = {s: a for a in sub._actions for s in a.option_strings}
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if token == "--":  # the rest are positional
            out += argv[i - 1:]
            break
        if not token.startswith("--"):
            out.append(token)
            continue
        name, eq, value = token.partition("=")
        dashed = name.replace("_", "-")
        if name not in actions and dashed in actions:
            name = dashed
        action = actions.get(name)
        negatable = isinstance(action, argparse.BooleanOptionalAction)
        if not (negatable or isinstance(action, argparse._StoreTrueAction)):
            out.append(name + eq + value)
            continue
        if not eq and i < len(argv) and argv[i].lower() in _TRUE + _FALSE:
            value, i = argv[i], i + 1
        try:
            on = str2bool(value) if value else True
        except argparse.ArgumentTypeError as e:
            sub.error(f"argument {name}: {e}")
        if negatable and name.startswith("--no-"):  # --no-fp16 False: fp16 on
            name, on = "--" + name.removeprefix("--no-"), not on
        if on:
            out.append(name)
        elif negatable:
            out.append("--no-" + name.removeprefix("--"))
        # a store_true flag given False: its default
    return out


def add_model_args(p: argparse.ArgumentParser, default_model: str | None = None) -> None:
    """--model and where it is looked for (checkpoints/names.py)."""
    if default_model is None:
        p.add_argument("--model", required=True, help="checkpoint folder (Hugging Face or CTranslate2), hub id, or a "
                                                      "Whisper name (tiny.en, base, ..., turbo, distil-*)")
    else:
        p.add_argument("--model", default=default_model,
                       help="checkpoint folder (Hugging Face or CTranslate2), hub id, or a Whisper name (tiny, base, "
                            "small, medium, large-v1/v2/v3, turbo, their .en variants, distil-*); tiny.en is bundled")
    p.add_argument("--model-dir", default=None,
                   help="where names are looked up first and imports are kept (default: $ENCDEC_CACHE, else "
                        "~/.cache/encdec-engine; without it the checkout's models/ folder is searched first)")
    p.add_argument("--no-download", action="store_true",
                   help="use only what is on this machine (as $HF_HUB_OFFLINE=1); default: a name or hub id not "
                        "found here is downloaded into the Hugging Face cache")


def add_engine_args(p: argparse.ArgumentParser, default_model: str | None = None) -> None:
    """The model and the EngineConfig options every command takes (see engine_kwargs)."""
    add_model_args(p, default_model)
    p.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "fastest"],
                   help="weights and activations type; auto: float32 on CPU, bfloat16 on CUDA; fastest: on the CPU "
                        "bfloat16 where it is native and faster here, else float32")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads; 0: $OMP_NUM_THREADS when set, else the cores this process may use")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences in one engine step")
    p.add_argument("--kv-cache-space-gb", type=float, default=None,
                   help="KV pool size in GiB (default: 2 on CPU; on CUDA what --gpu-memory-utilization leaves)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: share of the device for weights, activations and the KV pool")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: run decode eagerly, without CUDA graphs")
    p.add_argument("--quantization", choices=["int8"], default=None,
                   help="CPU: int8 weights with per-channel scales for every linear")
    p.add_argument("--compute-type", default=None, metavar="{" + ",".join(COMPUTE_TYPES) + "}",
                   help="faster-whisper's spelling: int8 (or int8_float32) = --quantization int8; float32, bfloat16; "
                        "int8_bfloat16: Whisper's encoder in bf16, its decoder int8; auto = --dtype fastest (int8 is "
                        "asked for by name)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "int8"], default="auto",
                   help="int8: KV cache rows quantized with per-group scales (about 4x the tokens of fp32)")


def _quantization_and_dtype(args: argparse.Namespace) -> tuple[str | None, str]:
    """--quantization/--dtype with faster-whisper's --compute-type folded in (contradictions refused)."""
    if args.compute_type is None:
        return args.quantization, args.dtype
    return fold_compute_type(args.compute_type, args.quantization, args.dtype, FLAGS)


def check_engine_args(args: argparse.Namespace) -> None:
    """Engine option values refused before anything loads."""
    if args.threads < 0:
        raise ValueError(f"--threads must be 0 (the default count) or more, got {args.threads}")
    _quantization_and_dtype(args)
    if args.model_dir is not None and os.path.exists(args.model_dir) and not os.path.isdir(args.model_dir):
        raise ValueError(f"--model-dir {args.model_dir} exists and is not a directory")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig fields every command takes (see add_engine_args)."""
    quantization, dtype = _quantization_and_dtype(args)
    return dict(dtype=dtype, device=args.device, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                kv_cache_space_gb=args.kv_cache_space_gb, gpu_memory_utilization=args.gpu_memory_utilization,
                enforce_eager=args.enforce_eager, threads=args.threads or None, quantization=quantization,
                kv_cache_dtype=args.kv_cache_dtype)


def resolve_model(args: argparse.Namespace) -> str:
    """The checkpoint folder `--model` names (a folder, a short name or a hub id), downloaded unless
    --no-download (checkpoints/names.py). The first use of the bundled default says that it is imported
    (the seconds before the progress bar moves)."""
    folder = first_import(args.model, args.model_dir)
    if folder is not None:
        print(f"first use of {args.model}: importing the bundled model into {folder} (once, a few seconds)",
              file=sys.stderr, flush=True)
    return str(resolve(args.model, args.model_dir, allow_download=not args.no_download))


@contextmanager
def loading() -> Iterator[None]:
    """Around a command's model load (resolving its name, which may import torch, the lazy import of
    the engine, building the LLM): Python's cyclic garbage collector paused. The imports and the model
    create about a million long-lived objects, and each full collection they trigger walks them all:
    0.13-0.15 s of a one-file transcription (tiny.en int8, from start to the first transcript 1.94 ->
    1.79 s; torch's import alone 0.68 -> 0.61 s). In the `encdec` program (FREEZE_LOADED) they are then
    frozen: without that, the first collection after the load walks them once more, during the work."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if FREEZE_LOADED:
            gc.freeze()
        if enabled:
            gc.enable()


def load_llm(args: argparse.Namespace, model: str | None = None, **overrides):
    """The command's LLM (the checkpoint `--model` names unless `model` is given; `overrides` replace
    engine_kwargs), torch and the engine imported lazily, all of it while `loading`."""
    with loading():
        from encdec_engine.llm import LLM  # lazy: torch and the engine (1.2 s), once the arguments are good

        return LLM(model=model or resolve_model(args), **{**engine_kwargs(args), **overrides})


def error(message: str) -> None:
    """One line on stderr, as every refusal of the CLI is written."""
    print(f"error: {message}", file=sys.stderr)


def warn(message: str) -> None:
    """One line on stderr: something that works, but the user should know."""
    print(f"warning: {message}", file=sys.stderr)
