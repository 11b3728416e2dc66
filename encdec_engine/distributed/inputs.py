"""A batch job's inputs: paths, folders, globs and JSONL manifests expanded into `JobInput`s, each with
the id the results file and `--resume` know it by, and the name its output files get.

Manifest lines (JSONL, one JSON value per line; blank lines are skipped):

    transcribe   {"audio": "calls/0001.wav", "id": "call-1", "output": "2024/call-1"}   or "calls/0001.wav"
    summarize    {"text": "A long document ...", "id": "doc-7"}  or  {"path": "docs/a.txt"}  or "docs/a.txt"

`id` defaults to the input's absolute path (inline text: its line number); `output` (transcribe) is the
output file name without extension (default: the audio file's name without its extension, as the single-machine CLI
names it). Relative paths in a manifest are relative to the manifest's folder. A prompt file for
`generate` is read as `encdec generate` reads it (any prompt format, optional "sampling_params"); a
prompt's id is its index, the single-machine command's request id.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from encdec_engine.inputs.prompt_files import load_prompts_with_params

# What a folder given as a transcription input contributes (librosa reads more; name those directly).
AUDIO_EXTENSIONS = frozenset({".wav", ".flac", ".mp3", ".ogg", ".opus", ".m4a", ".aac", ".webm", ".mp4", ".wma",
                              ".aif", ".aiff"})
TEXT_EXTENSIONS = frozenset({".txt", ".md"})
_GLOB_CHARS = frozenset("*?[")


@dataclass(frozen=True)
class JobInput:
    """One input of a job: `payload` goes to the worker (as JSON), the rest stays on the driver."""

    id: str
    payload: dict[str, Any]
    output: str | None = None  # output file name without extension, relative to the output folder
    source: str | None = field(default=None)  # the file it came from (shown in progress and errors)

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"an input id must be a non-empty string, got {self.id!r}")


def expand(specs: Iterable[str], extensions: frozenset[str]) -> list[tuple[Path, str]]:
    """(absolute path, output name) for each file a spec names: a file (kept even when missing: the
    worker reports it as that input's error), each matching file of a folder (recursively; the output
    name keeps the sub-folders), or each match of a glob. A folder or glob that matches nothing is a
    ValueError: it is almost certainly a typo, not an empty job."""
    out: list[tuple[Path, str]] = []
    for spec in specs:
        path = Path(spec).expanduser()
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in extensions)
            if not files:
                raise ValueError(f"folder {spec} has no files ending in {', '.join(sorted(extensions))}")
            out.extend((p.resolve(), str(p.relative_to(path).with_suffix(""))) for p in files)
        elif not path.exists() and _GLOB_CHARS & set(spec):
            files = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
            if not files:
                raise ValueError(f"pattern {spec} matches no file")
            out.extend((p.resolve(), p.stem) for p in files)
        else:
            out.append((path.resolve(), path.stem))
    return out


def audio_inputs(specs: Iterable[str] = (), manifest: str | Path | None = None) -> list[JobInput]:
    """The inputs of a transcription job."""
    items = [JobInput(str(p), {"audio": str(p)}, name, str(p)) for p, name in expand(specs, AUDIO_EXTENSIONS)]
    for where, value, base in _manifest_lines(manifest):
        entry = {"audio": value} if isinstance(value, str) else value
        audio = _field(entry, "audio", where, str)
        path = (base / Path(audio).expanduser()).resolve()
        output = _output_name(_field(entry, "output", where, str, path.stem), where)
        items.append(JobInput(_id(entry, where, str(path)), {"audio": str(path)}, output, str(path)))
    return _checked(items)


def text_inputs(specs: Iterable[str] = (), manifest: str | Path | None = None) -> list[JobInput]:
    """The inputs of a summarization job: text files (read by the worker) or inline text (summaries go to
    stdout and the results file, so no output names)."""
    items = [JobInput(str(p), {"path": str(p)}, None, str(p)) for p, _ in expand(specs, TEXT_EXTENSIONS)]
    for where, value, base in _manifest_lines(manifest):
        entry = {"path": value} if isinstance(value, str) else value
        if "text" in entry:
            line = where.rsplit(":", 1)[1]
            items.append(JobInput(_id(entry, where, line), {"text": _field(entry, "text", where, str)}, None, where))
            continue
        path = (base / Path(_field(entry, "path", where, str)).expanduser()).resolve()
        items.append(JobInput(_id(entry, where, str(path)), {"path": str(path)}, None, str(path)))
    return _checked(items)


def prompt_inputs(prompt_file: str | Path, base_params: dict[str, Any]) -> list[JobInput]:
    """The inputs of a generation job: each prompt with its sampling parameters (the run's, updated by
    the line's "sampling_params"), checked here so a bad line fails the job before any work."""
    items = [JobInput(str(i), {"prompt": prompt, "params": params}, None, f"{prompt_file}:{i}")
             for i, (prompt, params) in enumerate(load_prompts_with_params(prompt_file, base_params))]
    return _checked(items)


def _manifest_lines(manifest: str | Path | None):
    """(where, value, folder) for each non-blank line; `where` is "file:line" for error messages."""
    if manifest is None:
        return
    path = Path(manifest)
    if not path.is_file():
        raise FileNotFoundError(f"manifest {manifest} does not exist")
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{manifest}:{lineno}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(value, (str, dict)):
            raise ValueError(f"{where}: expected a path or an object, got {type(value).__name__}")
        yield where, value, path.parent


def _field(entry: dict, name: str, where: str, kind: type, default: Any = ...) -> Any:
    if name not in entry:
        if default is ...:
            raise ValueError(f"{where}: missing field {name!r}")
        return default
    value = entry[name]
    if not isinstance(value, kind) or (kind is str and not value):
        raise ValueError(f"{where}: field {name!r} must be a non-empty {kind.__name__}, got {value!r}")
    return value


def _output_name(value: str, where: str) -> str:
    """A manifest's "output" as a name inside the output folder, normalized ("./a//b" -> "a/b"), so
    that two spellings of one file are seen to collide; absolute paths and ".." are refused."""
    path = PurePosixPath(value)
    if path.is_absolute() or PureWindowsPath(value).drive or value.startswith("~"):
        raise ValueError(f"{where}: field 'output' must be a path relative to the output folder, got {value!r}")
    if ".." in path.parts or "\\" in value or "\0" in value:
        raise ValueError(f"{where}: field 'output' must stay inside the output folder (no '..' and no "
                         f"backslashes), got {value!r}")
    name = path.as_posix()
    if name in ("", "."):
        raise ValueError(f"{where}: field 'output' names no file, got {value!r}")
    return name


def _id(entry: dict, where: str, default: str) -> str:
    value = entry.get("id", default)
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: field 'id' must be a non-empty string or an integer, got {value!r}")
    return value


def _checked(items: list[JobInput]) -> list[JobInput]:
    """Refuse what would lose or mix up results: two inputs with one id, two writing the same files."""
    if not items:
        raise ValueError("the job has no inputs")
    ids: dict[str, str | None] = {}
    outputs: dict[str, str | None] = {}
    for item in items:
        if item.id in ids:
            raise ValueError(f"two inputs have the id {item.id!r} ({ids[item.id]} and {item.source}); "
                             "ids must be unique (a manifest may set them)")
        ids[item.id] = item.source
        if item.output is not None:
            other = outputs.setdefault(item.output, item.source)
            if other != item.source:
                raise ValueError(f"{other} and {item.source} would both be written as {item.output}.*; "
                                 "name their outputs apart (a manifest's \"output\" field) or run them apart")
    return items
