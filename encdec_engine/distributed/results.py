"""The results file of a batch job: JSONL, one row per input, written by the driver as rows stream back.

Exactly one row per input, even after a worker died and its batch was retried: the driver keeps the
ids it has written and drops a second row for one of them. `resume` keeps the rows of inputs that are
complete (no error, every output file there) and drops the rest (error rows, the torn last line of a
killed driver); the kept rows are rewritten atomically before the job appends to them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from encdec_engine.files import write_atomically

Row = dict[str, Any]


class ResultsFile:
    """Append-only JSONL rows keyed by "id"; `done` holds the complete rows a resumed job skips."""

    def __init__(self, path: str | Path, resume: bool = False, complete: Callable[[Row], bool] = lambda row: True):
        self.path = Path(path)
        if self.path.is_dir():
            raise ValueError(f"results file {self.path} is a folder")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.done: dict[str, Row] = {}
        if resume and self.path.exists():
            for row in read_rows(self.path):
                if row["id"] not in self.done and row.get("error") is None and complete(row):
                    self.done[row["id"]] = row
            write_atomically(self.path, "".join(json.dumps(row) + "\n" for row in self.done.values()))
        self._written = set(self.done)
        self._file: IO[str] = open(self.path, "a" if resume else "w", encoding="utf-8")

    def append(self, row: Row) -> bool:
        """Write `row` unless its id has a row already; flushed, so a killed driver loses at most the
        line it was writing (which `resume` drops). Returns whether it was written."""
        if row["id"] in self._written:
            return False
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        self._written.add(row["id"])
        return True

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

    def __enter__(self) -> ResultsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_rows(path: str | Path) -> list[Row]:
    """The rows of a results file; lines that are not a JSON object with an "id" (a torn last line)
    are skipped."""
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("id"), str):
            rows.append(row)
    return rows
