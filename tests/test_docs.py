"""The docs a newcomer reads agree with the code: each package's map (its `__init__.py` docstring) names
what the package holds, docs/architecture.md's package layout is the one scripts/write_architecture.py
writes from those maps, and every module path and class name the architecture doc gives exists. Every
doc a newcomer reads (the README, docs/, docs/notes/, models/' cards) names only paths, link targets,
`encdec` flags and modules that exist. No model is loaded; the whole file runs in about a second."""

from __future__ import annotations

import argparse
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


# Every doc a newcomer reads: the README, docs/ with its notes, and models/' cards.
NEWCOMER_DOCS = sorted({ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("docs/notes/*.md"),
                        *ROOT.glob("models/*.md")})
CLI_DOC = ROOT / "docs" / "cli.md"
FENCE = re.compile(r"^ *```[^\n]*\n(.*?)^ *```[ \t]*$", re.S | re.M)


def doc_id(doc: Path) -> str:
    return str(doc.relative_to(ROOT))


def prose_of(text: str) -> str:
    """The markdown outside its fenced code blocks."""
    return FENCE.sub("", text)


# A word of a span or a code block: brace groups (`models/{bart,t5}.py`) stay whole.
WORD = re.compile(r"""(?:\{[^{}\s]*\}|[^\s()\[\]'"=;|&,:`{}])+""")
SOURCE_SUFFIXES = (".py", ".c")


@cache
def ignored(ref: str) -> bool:
    """Whether git ignores the path (a folder that a script writes, like models/whisper-tiny.en/): such a
    path is there on one machine and not on another, so the docs may name it whether it is there or not."""
    names = [ref.rstrip("/") + "/"] + ([] if ref.endswith("/") else [ref])
    listing = subprocess.run(["git", "check-ignore", "--stdin"], cwd=ROOT, input="\n".join(names),
                             capture_output=True, text=True)
    return bool(listing.stdout.strip())


def path_refs(text: str, relative_modules: bool) -> list[str]:
    """The repository paths a text names: each word that starts with a top-level folder (`tests/...`,
    `scripts/...`, `encdec_engine/...`) and, with `relative_modules`, each `.py`/`.c` path with a folder
    (`speech/live/session.py`), which is relative to encdec_engine/. Braces are expanded; placeholders
    (`<name>`, `*`, `...`), absolute paths, `~` and `$VAR` paths, hub ids and URLs are not paths of the
    repository."""
    refs = []
    for word in WORD.findall(text):
        word = word.removeprefix("./").rstrip(".")
        if not re.fullmatch(r"[\w.{},/-]+", word) or "..." in word or "//" in word or word.startswith("/"):
            continue
        top = word.split("/")[0]
        if "/" in word and top in (*REPO_FOLDERS, "encdec_engine") or (
                relative_modules and "/" in word and word.endswith(SOURCE_SUFFIXES)):
            refs += expand_braces(word)
    return refs


@pytest.mark.parametrize("doc", NEWCOMER_DOCS, ids=doc_id)
def test_doc_paths_exist(doc: Path):
    """Every path a doc names exists: in its inline code spans each word that starts with a top-level
    folder (`tests/speech/test_vad.py`, `scripts/bench_whisper.py --rounds 2`, `docs/`, `prompts/audio/`,
    `encdec_engine/...`) or is a `.py`/`.c` path with a folder, which is relative to encdec_engine/
    (`speech/live/session.py`, `machine/threads.py`); in its fenced code blocks (commands, listings) each
    word that starts with a top-level folder. A folder that git ignores (the checkpoints scripts write
    under models/) passes: it exists on some machines only."""
    text = doc.read_text()
    refs = [ref for span in code_spans(text) for ref in path_refs(span, relative_modules=True)]
    refs += [ref for block in FENCE.findall(text) for ref in path_refs(block, relative_modules=False)]
    stale = sorted({ref for ref in refs if not resolves(ref) and not ignored(ref)})
    assert not stale, f"{doc_id(doc)} names paths that do not exist: {stale}"


def github_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a markdown file's headings: the heading's text (a link's text, no code
    marks) lowercased, every character but letters, digits, spaces, '-' and '_' dropped, each space a
    '-'; a repeated anchor gets -1, -2, ... ."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", prose_of(text), flags=re.M):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n, unique = 0, slug
        while unique in anchors:
            n += 1
            unique = f"{slug}-{n}"
        anchors.add(unique)
    return anchors


@pytest.mark.parametrize("doc", NEWCOMER_DOCS, ids=doc_id)
def test_doc_links_resolve(doc: Path):
    """Each relative markdown link `[text](path#anchor)` (outside code) leads somewhere: the path, relative
    to the doc's folder (none: the doc itself), exists in the repository, and the anchor is a heading of
    that file by GitHub's rule (`#limits-and-metrics` for "## Limits and metrics"). Links with a scheme
    (https:, mailto:) are not checked."""
    broken = []
    for target in re.findall(r"\]\(([^()\s]+)\)", prose_of(doc.read_text())):
        if re.match(r"[a-z][\w+.-]*:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists() or not file.is_relative_to(ROOT):
            broken.append(f"{target} (no file {path})")
        elif anchor and (file.suffix != ".md" or anchor not in github_anchors(file.read_text())):
            broken.append(f"{target} (no heading #{anchor} in {file.relative_to(ROOT)})")
    assert not broken, f"{doc_id(doc)} has broken links: {broken}"


@cache
def cli_flags() -> dict[str, set[str]]:
    """Each `encdec` subcommand's flags, in every spelling argparse registers (`-o` and `--output-dir`,
    `--fp16` and `--no-fp16`) and with the program's own (`--help`, `--version`); '' maps to them all."""
    from encdec_engine.cli.main import build_parser  # here: the file's other tests only read files

    parser = build_parser()
    top = {s for a in parser._actions for s in a.option_strings}
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = {name: top | {s for a in p._actions for s in a.option_strings} for name, p in sub.choices.items()}
    flags[""] = set().union(*flags.values())
    return flags


FLAG = re.compile(r"(?<![\w-])--?[A-Za-z][\w-]*\*?")


def encdec_runs(command: str) -> list[tuple[str, list[str]]]:
    """The `encdec` commands of a shell line, each as (subcommand or '', its flags): `encdec`, after
    environment assignments, may start the line or any part of a pipe or list (`ffmpeg ... | encdec
    transcribe --live -`); the flags are those up to that part's end."""
    runs = []
    for part in re.split(r"\|\|?|&&|;|\$\(|\)", command):
        words = part.split()
        while words and re.fullmatch(r"\$|\w+=\S*", words[0]):  # a prompt, VAR=value
            words.pop(0)
        if not words or words[0].rsplit("/", 1)[-1] != "encdec":
            continue
        subcommand = words[1] if len(words) > 1 and re.fullmatch(r"[a-z]+", words[1]) else ""
        runs.append((subcommand, FLAG.findall(" ".join(words[1:]))))
    return runs


def shell_lines(block: str) -> list[str]:
    """A code block's command lines: continuations (a trailing backslash) joined, `# comments` dropped."""
    return [re.sub(r"(^|\s)#.*", "", line) for line in block.replace("\\\n", " ").splitlines()]


def is_flag_of(flag: str, accepted: set[str]) -> bool:
    """`--max_line_width` is `--max-line-width` (the CLI takes openai-whisper's spellings, cli/args.py's
    `normalize_argv`); `--max-realtime-*` stands for the flags it starts."""
    flag = flag.replace("_", "-")
    if flag.endswith("*"):
        return any(known.startswith(flag[:-1]) for known in accepted)
    return flag in accepted


@pytest.mark.parametrize("doc", NEWCOMER_DOCS, ids=doc_id)
def test_doc_cli_flags_exist(doc: Path):
    """Every `encdec` flag a doc gives is one the CLI takes (encdec_engine.cli.main.build_parser).

    The rule, so that another program's flags (pip, pytest, ffmpeg, hf, the scripts/ benchmarks,
    openai-whisper, faster-whisper, whisper_streaming) are never taken for the CLI's: a flag is checked
    where the doc runs `encdec`, and in docs/cli.md, the CLI's reference.
    - An `encdec` command (a fenced code block's line, or an inline span, that runs `encdec`, alone or in a
      pipe or list): its subcommand must be one of the CLI's, and each flag after it, short or long, one
      that subcommand takes (`encdec serve --replicas 2`), or the union when no subcommand is given.
    - docs/cli.md: each inline span that starts with a flag (`--vad-threshold`, `-o/--output-dir`,
      `--live -`, `--max-realtime-*`, a prefix) holds flags some subcommand takes.
    Elsewhere a span that starts with a flag is not checked: the docs also give the benchmarks' flags
    that way (`--rounds 2`), and nothing but the prose says which program they belong to.
    A flag may use openai-whisper's underscores (`--word_timestamps`): the CLI accepts them."""
    flags = cli_flags()
    text = doc.read_text()
    commands = code_spans(text) + [line for block in FENCE.findall(text) for line in shell_lines(block)]
    unknown = []
    for command in commands:
        for subcommand, given in encdec_runs(command):
            if subcommand and subcommand not in flags:
                unknown.append(f"encdec {subcommand} (no such subcommand)")
                continue
            unknown += [f"encdec {subcommand} {flag}".replace("  ", " ") for flag in given
                        if not is_flag_of(flag, flags[subcommand])]
    if doc == CLI_DOC:
        unknown += [flag for span in code_spans(text) if span.startswith("-")
                    for flag in FLAG.findall(span) if not is_flag_of(flag, flags[""])]
    assert not unknown, f"{doc_id(doc)} gives flags the encdec CLI does not take: {sorted(set(unknown))}"


@cache
def top_level_names(module: Path) -> set[str]:
    """What a module defines or imports at its top level, under an `if` or `try` too (its attributes, as
    `from module import` sees them), and the names its `__all__` lists (those a module `__getattr__`
    imports lazily, as encdec_engine's own)."""
    names: set[str] = set()
    body = list(ast.parse(module.read_text()).body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.If, ast.Try)):
            body += node.body + node.orelse + getattr(node, "finalbody", [])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            if any(getattr(t, "id", None) == "__all__" for t in node.targets) and isinstance(node.value, ast.List):
                names.update(e.value for e in node.value.elts if isinstance(e, ast.Constant))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


def dotted_ok(dotted: str, imported: tuple[str, ...] = ()) -> bool:
    """`encdec_engine.speech.live.events` names packages down to a module (a file or a package), and what
    follows the module (`encdec_engine.llm.LLM`), like what is imported from it, is one of its top-level
    names or a module of the package. Files are read, nothing is imported."""
    parts = dotted.split(".")
    here = ROOT / parts[0]
    rest: list[str] = []
    for i, part in enumerate(parts[1:], 1):
        if (here / part / "__init__.py").is_file():
            here = here / part
        elif (here / f"{part}.py").is_file():
            here, rest = here / f"{part}.py", parts[i + 1:]
            break
        else:
            rest = parts[i:]
            break
    module = here if here.suffix == ".py" else here / "__init__.py"
    wanted = [*rest[:1], *imported]
    return all(name in top_level_names(module) or (module.name == "__init__.py" and (
        (here / name / "__init__.py").is_file() or (here / f"{name}.py").is_file())) for name in wanted)


DOTTED = re.compile(r"(?<![\w.])encdec_engine(?:\.\w+)+")


@pytest.mark.parametrize("doc", NEWCOMER_DOCS, ids=doc_id)
def test_doc_module_names_exist(doc: Path):
    """Every dotted module name a doc gives (`encdec_engine.speech.live.events` in a span, `python -m
    encdec_engine.cli`, `from encdec_engine.x import A, B` in a code block) is a module path of the
    package, and a name after it or imported from it is defined there (see dotted_ok)."""
    text = doc.read_text()
    stale = [name for span in code_spans(text) for name in DOTTED.findall(span) if not dotted_ok(name)]
    for block in FENCE.findall(text):
        for module, names in re.findall(r"^\s*from\s+(encdec_engine[\w.]*)\s+import\s+\(?([\w, ]+)", block,
                                        flags=re.M):
            imported = tuple(n.split(" as ")[0].strip() for n in names.split(",") if n.strip())
            if not dotted_ok(module, imported):
                stale.append(f"from {module} import {', '.join(imported)}")
        stale += [name for name in DOTTED.findall(re.sub(r"^\s*from\s+\S+", "", block, flags=re.M))
                  if not dotted_ok(name)]
    assert not stale, f"{doc_id(doc)} names modules or names that do not exist: {sorted(set(stale))}"


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
