"""The workers of a batch job: classes that the driver runs as Ray actors (one `LLM` each, the model
loaded once) and calls on one batch of inputs at a time.

A batch arrives as the ids and payloads (JSON) of its inputs and goes through the engine in one call
(`LLM.transcribe` / `summarize` / `generate` over the whole batch, so its inputs share continuous
batching); it leaves as one result row (JSON) per input. A bad input is an error row; only a worker
that dies (the driver splits and retries its batch) or a broken engine fails a batch.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

import torch

from encdec_engine.checkpoints.names import resolve_job_model
from encdec_engine.speech.writers import segment_to_dict
from encdec_engine.inputs.documents import MAX_DOCUMENT_BYTES, read_document
from encdec_engine.llm import LLM
from encdec_engine.sampling_params import SamplingParams


class _Worker:
    """One engine per actor; subclasses turn a batch's payloads into result rows."""

    def __init__(self, model: str | None, engine_kwargs: dict[str, Any], threads: int,
                 options: dict[str, Any], limits: dict[str, Any] | None = None) -> None:
        torch.set_num_threads(threads)
        self.llm = LLM(model=resolve_job_model(model), **engine_kwargs)
        self.options, self.limits = options, limits or {}
        self.worker = {"node": socket.gethostname(), "pid": os.getpid()}

    def process(self, ids: list[str], inputs: list[str]) -> list[str]:
        """The rows (JSON) of a batch of inputs (their payloads' JSON)."""
        rows = self.run(ids, [json.loads(s) for s in inputs])
        return [json.dumps({"id": i, **row, "worker": self.worker}) for i, row in zip(ids, rows)]

    def ready(self) -> int:
        """Answers once the actor (and its model) is up: its process id."""
        return os.getpid()

    def run(self, ids: list[str], payloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
        raise NotImplementedError

    @staticmethod
    def error_row(input_id: str, payload: dict[str, Any], error: str) -> dict[str, Any]:
        """The row of an input that got no result from any worker (every one that took it died)."""
        raise NotImplementedError


class TranscribeWorker(_Worker):
    """Rows: path, text, language, duration, segments (openai-whisper's segment dicts), error."""

    def run(self, ids: list[str], payloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
        paths = [p["audio"] for p in payloads]
        results = self.llm.transcribe(paths, **self.options)
        return [{"path": path, "text": t.text, "language": t.language, "duration": t.duration,
                 "segments": [segment_to_dict(s) for s in t.segments], "error": t.error}
                for path, t in zip(paths, results)]

    @staticmethod
    def error_row(input_id: str, payload: dict[str, Any], error: str) -> dict[str, Any]:
        return {"id": input_id, "path": payload["audio"], "text": None, "language": None, "duration": None,
                "segments": [], "error": error}


class SummarizeWorker(_Worker):
    """Rows: path (None for inline text), text (the summary), error."""

    def run(self, ids: list[str], payloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
        rows, texts = [], {}
        limit = self.limits.get("max_document_bytes", MAX_DOCUMENT_BYTES)
        for i, p in enumerate(payloads):
            rows.append({"path": p.get("path"), "text": None, "error": None})
            try:
                text = _inline_text(p["text"], limit) if "text" in p else read_document(p["path"], limit)
            except (OSError, ValueError) as e:
                rows[i]["error"] = f"{p['path']}: {e.strerror}" if isinstance(e, OSError) else str(e)
                continue
            texts[i] = text
        for i, summary in zip(texts, self._summaries(list(texts.values()))):
            rows[i]["text"], rows[i]["error"] = summary
        return rows

    @staticmethod
    def error_row(input_id: str, payload: dict[str, Any], error: str) -> dict[str, Any]:
        return {"id": input_id, "path": payload.get("path"), "text": None, "error": error}

    def _summaries(self, texts: list[str]) -> list[tuple[str | None, str | None]]:
        """(summary, error) per text; the batch runs at once, and only when some text failed in it are
        the texts run one by one to tell which (a failure costs time, never another text's summary)."""
        try:
            return [(s, None) for s in self.llm.summarize(texts, **self.options)]
        except RuntimeError:
            if len(texts) == 1:
                raise
        out: list[tuple[str | None, str | None]] = []
        for text in texts:
            try:
                out.append((self.llm.summarize([text], **self.options)[0], None))
            except RuntimeError as e:
                out.append((None, str(e)))
        return out


class GenerateWorker(_Worker):
    """Rows as `encdec generate` writes them (`RequestOutput.record`), with "error" always there."""

    def run(self, ids: list[str], payloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = [{} for _ in payloads]
        valid = []
        for i, p in enumerate(payloads):
            params = SamplingParams(**p["params"])
            try:
                self.llm.engine.process_request(p["prompt"], params)  # a bad prompt is its own error row
            except ValueError as e:
                rows[i] = {"request_id": ids[i], "text": None, "token_ids": [], "finish_reason": "error",
                           "error": str(e)}
                continue
            valid.append((i, p["prompt"], params))
        outs = self.llm.generate([v[1] for v in valid], [v[2] for v in valid], use_tqdm=False) if valid else []
        for (i, _, _), out in zip(valid, outs):
            rows[i] = {**out.record(), "request_id": ids[i], "error": out.error}
        return rows

    @staticmethod
    def error_row(input_id: str, payload: dict[str, Any], error: str) -> dict[str, Any]:
        return {"id": input_id, "request_id": input_id, "text": None, "token_ids": [], "finish_reason": "error",
                "error": error}


def _inline_text(text: str, max_bytes: int | None) -> str:
    size = len(text.encode("utf-8"))
    if max_bytes is not None and size > max_bytes:
        raise ValueError(f"the text is {size} bytes, more than the limit of {max_bytes} bytes per document "
                         "(--max-document-bytes)")
    if not text.strip():
        raise ValueError("the text is empty")
    return text
