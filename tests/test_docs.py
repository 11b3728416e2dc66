"""The docs a newcomer reads agree with the code: each package's map (its `__init__.py` docstring) names
what the package holds, docs/architecture.md's package layout is the one scripts/write_architecture.py
writes from those maps, and every module path and class name the architecture doc gives exists.
No model is loaded; the whole file runs in about a second."""

from __future__ import annotations

import ast
import builtins
import importlib.util
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "encdec_engine"
DOC = ROOT / "docs" / "architecture.md"
REPO_FOLDERS = ("tests", "scripts", "docs", "models", "prompts")


def load_writer():
    """scripts/write_architecture.py as a module (scripts/ is not a package)."""
    if "write_architecture" not in sys.modules:
        spec = importlib.util.spec_from_file_location("write_architecture", ROOT / "scripts" / "write_architecture.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["write_architecture"] = module  # dataclasses look their module up here
        spec.loader.exec_module(module)
    return sys.modules["write_architecture"]


writer = load_writer()


def held(package: Path) -> set[str]:
    """What a package's map must name: its modules and other sources (`name.py`, `name.c`) and its
    folders (`name/`, subpackages); `__init__.py` itself may be named or not."""
    names = {p.name for p in package.iterdir() if p.is_file() and p.suffix in (".py", ".c")}
    names |= {p.name + "/" for p in package.iterdir() if p.is_dir() and p.name != "__pycache__"}
    return names - {"__init__.py"}


@pytest.mark.parametrize("package", writer.packages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_package_maps_exactly_what_it_holds(package: Path):
    doc = writer.docstring(package)
    lines = doc.splitlines()
    assert len(lines) > 2 and lines[0].strip() and not lines[1].strip(), (
        f"{package.relative_to(ROOT)}/__init__.py: its docstring starts with one line (what the package is for "
        "and who uses it), then a blank line and the map")
    named = [name for entry in writer.read_map(package) for name in entry.names]
    assert len(named) == len(set(named)), f"named twice: {sorted(n for n in named if named.count(n) > 1)}"
    mapped = set(named) - {"__init__.py"}
    missing, stale = sorted(held(package) - mapped), sorted(mapped - held(package))
    assert not missing and not stale, (
        f"{package.relative_to(ROOT)}/__init__.py's map: not named {missing}, named but absent {stale}; "
        "update the map, then run `python scripts/write_architecture.py`")


def test_architecture_layout_is_written_from_the_maps():
    current = DOC.read_text()
    assert writer.render(current) == current, (
        "docs/architecture.md's package layout differs from the package maps: "
        "run `python scripts/write_architecture.py` (`--check` shows the diff)")


def code_spans(text: str) -> list[str]:
    """The inline code spans (`...`) of markdown outside its fenced blocks."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.findall(r"`([^`\n]+)`", prose)


def code_blocks(text: str) -> list[str]:
    return re.findall(r"```\n(.*?)```", text, flags=re.S)


def expand_braces(token: str) -> list[str]:
    """`models/{bart,t5}.py` -> models/bart.py, models/t5.py."""
    match = re.search(r"\{([^{}]*)\}", token)
    if not match:
        return [token]
    return [p for part in match[1].split(",")
            for p in expand_braces(token[:match.start()] + part + token[match.end():])]


def resolves(ref: str) -> bool:
    """A path the doc gives: relative to encdec_engine/, or to the repository for its top-level folders."""
    ref = ref.removeprefix("encdec_engine/")
    return ref in ("", "encdec_engine") or (PACKAGE / ref).exists() or (
        ref.split("/")[0] in REPO_FOLDERS and (ROOT / ref).exists())


@cache
def tracked_files() -> list[str]:
    """The files git tracks and the new ones it does not ignore (not committed yet), as they are on disk."""
    listing = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True)
    return [name for name in listing.stdout.splitlines() if (ROOT / name).is_file()]


PATH_SPAN = re.compile(r"^[\w.{},/-]+(?:\.(?:py|c|md|json|jsonl|sh|toml)|/)$")
MODULE_TOKEN = re.compile(r"(?<![\w./{},*-])[\w{},]+(?:/[\w{},]+)*\.(?:py|c)\b")


def test_architecture_paths_exist():
    """Backticked paths (`attention/metadata.py`, `speech/`, `tests/test_layering.py`) must exist; in the
    code blocks, so must each module a path names (`inputs/prompts.py`), and a bare module name
    (`timeline.py`) must be the name of a file in the repository."""
    text = DOC.read_text()
    stale = [ref for span in code_spans(text) if PATH_SPAN.match(span)
             for ref in expand_braces(span) if not resolves(ref)]
    basenames = {Path(f).name for f in tracked_files()} | {p.name for p in PACKAGE.rglob("*.py")}
    for block in code_blocks(text):
        for token in MODULE_TOKEN.findall(block):
            for ref in expand_braces(token):
                if not (resolves(ref) if "/" in ref else ref in basenames):
                    stale.append(ref)
    assert not stale, f"docs/architecture.md names paths that do not exist: {sorted(set(stale))}"


@cache
def defined_names() -> dict[str, set[str]]:
    """Every name that encdec_engine defines (classes, functions, assignments) or imports, each with the
    names its class body defines (fields, methods, attributes set on self) when it is a class."""
    names: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                members = names.setdefault(node.name, set())
                for item in ast.walk(node):
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        members.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        members.add(item.target.id)
                    elif isinstance(item, ast.Assign):
                        members.update(t.id for t in item.targets if isinstance(t, ast.Name))
                    elif isinstance(item, ast.Attribute) and getattr(item.value, "id", None) == "self":
                        members.add(item.attr)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.setdefault(node.name, set())
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        names.setdefault(target.id, set())
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.setdefault(node.target.id, set())
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    names.setdefault((alias.asname or alias.name).split(".")[-1], set())
    return names


# CamelCase words of the code blocks that name no code: techniques, products and formats.
NOT_CODE = {"ALiBi", "CTranslate2", "LocalAgreement", "OpenAI", "OpenAPI", "RoPE"}


def unknown_name(ref: str) -> bool:
    first, _, member = ref.partition(".")
    names = defined_names()
    if first not in names:
        return not hasattr(builtins, first)
    return bool(member) and bool(names[first]) and member not in names[first]


def test_architecture_class_names_exist():
    """Backticked names that start with a capital (`SequenceGroup`, `LLM.generate`, `ValueError`) and the
    CamelCase words of the code blocks (SequenceGroupMetadata, AttentionView) must be defined or imported
    somewhere in encdec_engine/ (or be Python builtins); a `Class.member` must be a member of the class."""
    text = DOC.read_text()
    refs = [span for span in code_spans(text) if re.fullmatch(r"[A-Z]\w*(?:\.\w+)?", span)]
    for block in code_blocks(text):
        for word in re.findall(r"\b[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*\b", block):
            if sum(c.isupper() for c in word) >= 2 and word not in NOT_CODE:
                refs.append(word[:-1] if word.endswith("s") and word[:-1] in defined_names() else word)
    stale = sorted({ref for ref in refs if unknown_name(ref)})
    assert not stale, f"docs/architecture.md names what encdec_engine does not define: {stale}"


TEXT_SUFFIXES = (".py", ".md", ".sh", ".toml", ".txt", ".json", ".c")
# A home or workspace folder of some machine, or a temporary folder that a run made.
NOT_IN_A_PATH = r"(?<![\w.~$}/-])"  # what may not come before: a relative path, ~, $HOME, a URL's host
MACHINE_PATH = re.compile(
    NOT_IN_A_PATH + r"/(?:root|work)(?=/|$|[\s`'\"),;:])"  # /root, /work/...
    + "|" + NOT_IN_A_PATH + r"/(?:home|Users)/\w"  # /home/<user>, /Users/<user>
    + "|" + NOT_IN_A_PATH + r"/tmp/(?:(?:tmp|pytest-of-)\w*|(?=\w*\d)(?=\w*[a-z])[a-z0-9_]{8,})")  # mkdtemp, pytest


def test_no_machine_specific_paths():
    """No text file of the repository (tracked, or new and not ignored) names a path of one machine.

    The rule: an absolute path under /root, /work, /home/<user> or /Users/<user>, or a /tmp folder that a
    run made (/tmp/tmp..., /tmp/pytest-of-..., or a random-looking name like /tmp/x8k2j1z0), is
    machine-specific. Everything else passes: /tmp alone or with a plain example name (/tmp/models),
    system folders (/usr, /proc, /dev, /etc, /opt/wheels), placeholders (/shared/... in the docs), paths
    under ~ or $HOME, and paths relative to the checkout. This file spells the patterns out, so it is not
    scanned."""
    found = []
    for name in tracked_files():
        path = ROOT / name
        if not name.endswith(TEXT_SUFFIXES) or path == Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if MACHINE_PATH.search(line):
                found.append(f"{name}:{number}: {line.strip()[:120]}")
    assert not found, "machine-specific paths:\n" + "\n".join(found)
