"""Write the "## Package layout" section of docs/architecture.md from the package maps.

Each package of encdec_engine/ says in its `__init__.py` docstring what it is for and, in a map, what
each of its modules and subpackages holds; those maps are the one source of the layout the doc shows:

    first line                     what the package is for and who uses it
    (blank line)
        a.py                       a description, one line; longer ones go on in lines
        b.py, c.py                 indented to (at least past) the names
        sub/                       a subpackage, mapped again in its own __init__.py

An entry starts with exactly four spaces; its names (`name.py`, `name.c` or `name/`, comma-separated) end
at two spaces, and its description follows. tests/test_docs.py checks that every package's map names
exactly what the package holds, and that the doc equals what this script writes.

    python scripts/write_architecture.py           # rewrite the section in docs/architecture.md
    python scripts/write_architecture.py --check   # exit 1 with a diff when the doc is out of date
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "encdec_engine"
DOC = ROOT / "docs" / "architecture.md"
HEADING = "## Package layout"
WIDTH = 112  # the longest line of the code block
MIN_COLUMN = 22  # where descriptions start at the least (the doc's top-level column)

# The repository's other top-level folders, which have no __init__.py to carry a map.
REPO_FOLDERS = {
    "models/": "a card per architecture (bart.md, mbart.md, marian.md, m2m100.md, t5.md, whisper.md, gpt2.md, "
               "llama.md), configs/ (the tiny test and benchmark configs as JSON), and, git-ignored, checkpoints "
               "that scripts/make_checkpoints.py writes (models/whisper-tiny.en/, random-init "
               "models/bart-small/ ...)",
    "tests/": "the pytest suite, a folder per package (tests/engine/, tests/speech/, ...); random-init "
              "checkpoints made on the fly from models/configs/",
    "scripts/": "setup, benchmarks (bench_*.py), make_checkpoints.py, write_architecture.py (this section)",
    "prompts/": "example prompt files, documents and speech samples (audio/, made by "
                "scripts/make_speech_samples.py with espeak-ng; transcripts.json has the spoken text)",
    "docs/": "these pages; notes/ the dated history of the performance work",
}

ENTRY = re.compile(r"^    (?P<names>[\w.]+(?:, [\w.]+)*/?)\s{2,}(?P<text>\S.*)$")
NAME = re.compile(r"^\w[\w.]*(?:\.py|\.c|/)$")


@dataclass(frozen=True)
class Entry:
    names: tuple[str, ...]  # as the map spells them: "a.py", "sub/"
    text: str  # the description, its lines joined


def docstring(package: Path) -> str:
    # clean=False: cleaning would strip the map's indent from a docstring that is all map
    return ast.get_docstring(ast.parse((package / "__init__.py").read_text()), clean=False) or ""


def read_map(package: Path) -> list[Entry]:
    """The entries of a package's map, in the map's order."""
    entries: list[Entry] = []
    previous_was_entry = False
    for line in docstring(package).splitlines():
        match = ENTRY.match(line)
        names = tuple(match["names"].split(", ")) if match else ()
        if match and all(NAME.match(n) for n in names):
            entries.append(Entry(names, match["text"].strip()))
            previous_was_entry = True
        elif previous_was_entry and line.startswith("     ") and line.strip():
            last = entries[-1]
            entries[-1] = Entry(last.names, f"{last.text} {line.strip()}")
        else:
            previous_was_entry = False
    return entries


def packages(root: Path = PACKAGE) -> list[Path]:
    """Every package under root, root first."""
    return [root, *sorted(p.parent for p in root.rglob("*/__init__.py") if "__pycache__" not in p.parts)]


def entry_lines(indent: int, names: str, text: str, column: int) -> list[str]:
    head = " " * indent + names
    head = head.ljust(column) if len(head) + 2 <= column else head + "  "
    lines = textwrap.wrap(text, WIDTH - column, break_long_words=False, break_on_hyphens=False) or [""]
    if len(head) > column:  # names past the column: the first line is that much shorter
        lines = textwrap.wrap(text, WIDTH - len(head), break_long_words=False, break_on_hyphens=False)
        rest = " ".join(lines[1:])
        lines = lines[:1] + textwrap.wrap(rest, WIDTH - column, break_long_words=False, break_on_hyphens=False)
    return [head + lines[0], *(" " * column + line for line in lines[1:])]


def tree(package: Path, indent: int, parent_column: int = MIN_COLUMN) -> list[str]:
    """A package's map as tree lines, each subpackage's own map under its entry. A package's descriptions
    share a column, right of its longest names (those of 30 characters or less) and never left of its
    parent's."""
    entries = read_map(package)
    fitting = [len(", ".join(e.names)) for e in entries if len(", ".join(e.names)) <= 30]
    column = max(parent_column, indent + max(fitting, default=0) + 2)
    lines = []
    for entry in entries:
        lines += entry_lines(indent, ", ".join(entry.names), entry.text, column)
        if len(entry.names) == 1 and entry.names[0].endswith("/"):
            lines += tree(package / entry.names[0].rstrip("/"), indent + 2, column)
    return lines


def layout() -> str:
    """The code block of the section: encdec_engine/ and its packages, then the repository's other folders."""
    lines = ["encdec_engine/", *tree(PACKAGE, 2)]
    for folder, text in REPO_FOLDERS.items():
        lines += entry_lines(0, folder, text, MIN_COLUMN)
    return "\n".join(lines) + "\n"


def render(doc: str) -> str:
    """The doc with its package layout's code block (the first after the heading) replaced."""
    start = doc.index(HEADING + "\n")
    open_fence = doc.index("```\n", start) + len("```\n")
    close_fence = doc.index("```\n", open_fence)
    return doc[:open_fence] + layout() + doc[close_fence:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1, printing a diff, when the doc differs")
    args = parser.parse_args(argv)
    current = DOC.read_text()
    wanted = render(current)
    if args.check:
        if current == wanted:
            return 0
        sys.stdout.writelines(difflib.unified_diff(current.splitlines(keepends=True), wanted.splitlines(keepends=True),
                                                   "docs/architecture.md", "as written from the package maps"))
        return 1
    if current != wanted:
        DOC.write_text(wanted)
        print(f"wrote the package layout of {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
