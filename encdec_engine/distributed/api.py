"""Batch jobs from Python: `transcribe`, `summarize` and `generate` over a Ray cluster.

Each takes its inputs (see `inputs.py`: paths, folders, globs, a manifest, a prompt file), the model
(None: the default tiny.en; else a folder at the same path on every node), the cluster (`address`,
`num_workers`, `threads_per_worker`) and where results go, runs the job and returns one row per input
in input order. `stream=True` returns an iterator of the rows as they arrive instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from encdec_engine.distributed.cluster import ClusterOptions
from encdec_engine.distributed.inputs import audio_inputs, prompt_inputs, text_inputs
from encdec_engine.distributed.jobs import Job, Outputs, run
from encdec_engine.distributed.results import Row
from encdec_engine.checkpoints.names import resolve_job_model
from encdec_engine.inputs.documents import MAX_DOCUMENT_BYTES
from encdec_engine.speech.options import TranscribeOptions
from encdec_engine.speech.results import Segment, Transcription, Word
from encdec_engine.speech.writers import OUTPUT_FORMATS, write_transcription

# A worker holds about 350 MB per hour of audio it transcribes; longer inputs are refused (an error row,
# from the header before decoding) unless max_audio_seconds says otherwise (None: no limit).
MAX_AUDIO_SECONDS = 4 * 3600.0


def transcribe(audio: str | Iterable[str] = (), model: str | None = None, *, manifest: str | Path | None = None,
               output_dir: str | Path | None = None, output_format: str | None = None, subtitles=None,
               results: str | Path | None = None, resume: bool = False, language: str | None = None,
               task: str = "transcribe", batch_size: int = 16, address: str | None = None,
               num_workers: int | None = None, threads_per_worker: int = 1, engine: dict[str, Any] | None = None,
               progress: bool = True, stream: bool = False, **options) -> list[Row] | Iterator[Row]:
    """Transcribe audio files; rows have path, text, language, duration, segments and error.

    `output_dir` / `output_format` write the files `encdec transcribe` writes (`output_format` "all" when
    only a folder is given), each atomically; `results` (default: `output_dir`/results.jsonl when files
    are written) is the JSONL of rows; `resume` skips inputs whose row and files are complete.
    `options` are TranscribeOptions fields, checked before the cluster starts; `max_audio_seconds`
    defaults to `MAX_AUDIO_SECONDS` here."""
    options.setdefault("max_audio_seconds", MAX_AUDIO_SECONDS)
    TranscribeOptions(language=language, task=task, **options)  # bad values fail before any work
    inputs = audio_inputs([audio] if isinstance(audio, str) else audio, manifest)
    fmt = output_format or ("all" if output_dir is not None else None)
    out_dir = Path(output_dir if output_dir is not None else ".")
    if fmt is not None:
        if out_dir.exists() and not out_dir.is_dir():
            raise ValueError(f"output folder {out_dir} exists and is not a directory")
        if results is None:
            results = out_dir / "results.jsonl"
    formats = OUTPUT_FORMATS if fmt == "all" else (fmt,)
    output = {i.id: i.output for i in inputs}

    def write(row: Row) -> None:
        if fmt is not None and row["error"] is None:
            name = Path(output[row["id"]])
            write_transcription(transcription_from_row(row), fmt, out_dir / name.parent, row["path"], subtitles,
                                stem=name.name)

    def complete(row: Row) -> bool:
        name = output.get(row["id"])
        return fmt is None or (name is not None and all((out_dir / f"{name}.{f}").is_file() for f in formats))

    job = Job("transcribe", inputs, local_model(model, address), engine or {},
              dict(language=language, task=task, **options), batch_size)
    outputs = Outputs(_str(results), resume, write, complete, progress, unit="file")
    return _finish(job, _cluster(address, num_workers, threads_per_worker, quiet=not progress), outputs, stream)


def summarize(files: str | Iterable[str] = (), model: str | None = None, *, manifest: str | Path | None = None,
              results: str | Path | None = None, resume: bool = False, batch_size: int = 16,
              address: str | None = None, num_workers: int | None = None, threads_per_worker: int = 1,
              engine: dict[str, Any] | None = None, progress: bool = True, stream: bool = False,
              max_document_bytes: int | None = MAX_DOCUMENT_BYTES, **overrides) -> list[Row] | Iterator[Row]:
    """Summarize text files (or a manifest's inline texts) as `LLM.summarize` does; rows have path, text
    (the summary) and error. `overrides` replace SamplingParams fields of the checkpoint's config; a
    document over `max_document_bytes` is an error row, refused before it is read."""
    if model is None:
        raise ValueError("summarize needs a model (a BART checkpoint folder)")
    inputs = text_inputs([files] if isinstance(files, str) else files, manifest)
    job = Job("summarize", inputs, local_model(model, address), engine or {}, overrides, batch_size,
              limits={"max_document_bytes": max_document_bytes})
    return _finish(job, _cluster(address, num_workers, threads_per_worker, quiet=not progress),
                   Outputs(_str(results), resume, progress=progress), stream)


def generate(prompt_file: str | Path, model: str | None = None, *, results: str | Path | None = None,
             resume: bool = False, batch_size: int = 64, address: str | None = None, num_workers: int | None = None,
             threads_per_worker: int = 1, engine: dict[str, Any] | None = None, progress: bool = True,
             stream: bool = False, **params) -> list[Row] | Iterator[Row]:
    """Run a prompt file as `encdec generate` does (`params`: SamplingParams fields for every line, a
    line's "sampling_params" override them); rows have request_id, text, token_ids, finish_reason, error."""
    if model is None:
        raise ValueError("generate needs a model (a checkpoint folder)")
    job = Job("generate", prompt_inputs(prompt_file, params), local_model(model, address), engine or {}, {},
              batch_size)
    return _finish(job, _cluster(address, num_workers, threads_per_worker, quiet=not progress),
                   Outputs(_str(results), resume, progress=progress, unit="prompt"), stream)


def transcription_from_row(row: Row):
    """The Transcription a transcribe row holds (what `write_transcription` renders)."""
    segments = []
    for s in row["segments"]:
        fields = {k: v for k, v in s.items() if k != "words"}
        words = None if s.get("words") is None else [Word(**w) for w in s["words"]]
        segments.append(Segment(**fields, words=words))
    return Transcription(row["text"], row["language"], segments, row["duration"], row["path"], row["error"])


def local_model(model: str | None, address: str | None) -> str | None:
    """The model folder, checked here when the job runs on this machine: a missing folder fails before a
    cluster starts. On another cluster the workers check their own path (the driver may not have it)."""
    if model is None:
        return None
    on_this_machine = address is None and not os.environ.get("RAY_ADDRESS")
    if on_this_machine or Path(model).expanduser().is_dir():
        return resolve_job_model(model)
    return model


def _cluster(address: str | None, num_workers: int | None, threads_per_worker: int, quiet: bool) -> ClusterOptions:
    return ClusterOptions(address, num_workers, threads_per_worker, quiet=quiet)


def _str(path: str | Path | None) -> str | None:
    return None if path is None else str(path)


def _finish(job: Job, cluster: ClusterOptions, outputs: Outputs, stream: bool) -> list[Row] | Iterator[Row]:
    rows = run(job, cluster, outputs)
    if stream:
        return rows
    by_id = {row["id"]: row for row in rows}
    return [by_id[i.id] for i in job.inputs]
