"""Imports run one way, down: cli -> distributed -> server -> llm -> speech/translation -> engine -> worker/inputs ->
models -> attention/checkpoints/machine -> quantization -> layers -> common, with no circle anywhere.

The engine core (engine/, worker/, attention/, models/, layers/, quantization/) is model-agnostic: it never
imports the speech pipeline (speech/), which drives the engine from above. A project import inside a
function is allowed only where it saves measured start-up time, and says so in a "lazy:" comment.
"""

import ast
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "encdec_engine"
LEVELS = {
    "sequence": 0, "sampling_params": 0, "compute_types": 0, "outputs": 0, "config": 0, "cache": 0, "files": 0, "probes": 0,
    "layers": 1,
    "quantization": 2,
    "attention": 3, "checkpoints": 3, "machine": 3,
    "models": 4,
    "worker": 5, "inputs": 5,
    "engine": 6,
    "speech": 7, "translation": 7,
    "llm": 8,
    "server": 9,
    "distributed": 10,  # batch jobs and replicated serving on Ray; its flags and commands live in cli/
    "cli": 11,
}
CORE = ("engine", "worker", "machine", "attention", "models", "layers", "quantization")
SPEECH = "encdec_engine.speech"


def level(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "encdec_engine" or len(parts) < 2:
        return None
    return LEVELS.get(parts[1])


def imported_modules(tree: ast.AST) -> set[str]:
    """Every module an import in the tree names, wherever it stands (in functions and TYPE_CHECKING
    blocks too); `from a import b` names a and a.b, since b may be a module."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def package_imports(*packages: str):
    """(file, imported module) for every import of every module under the given packages (all: none given)."""
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        if packages and rel.parts[1] not in packages:
            continue
        for name in sorted(imported_modules(ast.parse(path.read_text()))):
            yield rel, name


def is_speech(module: str) -> bool:
    return module == SPEECH or module.startswith(SPEECH + ".")


def test_no_module_imports_from_a_layer_above_it():
    violations = []
    for rel, name in package_imports():
        own, other = level(".".join(rel.parts)), level(name)
        if own is not None and other is not None and other > own:
            violations.append(f"{rel} imports {name}")
    assert not violations, "\n".join(violations)


def test_every_package_has_a_level():
    names = {p.name.removesuffix(".py") for p in PKG.iterdir() if not p.name.startswith("_") and p.name != "py.typed"}
    assert names == set(LEVELS)


def test_the_engine_core_never_imports_speech():
    violations = [f"{rel} imports {name}" for rel, name in package_imports(*CORE) if is_speech(name)]
    assert not violations, "\n".join(violations)


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        out[".".join(rel.parts[:-1] if rel.parts[-1] == "__init__" else rel.parts)] = path
    return out


def _graph() -> dict[str, set[str]]:
    """module -> the project modules it imports, wherever the import stands (`from a import b` counts a.b
    when b is a module, else a)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        found = set()
        for other in imported_modules(ast.parse(path.read_text())):
            while other and other not in modules:
                other = other.rpartition(".")[0]
            if other and other not in (name, "encdec_engine"):
                found.add(other)
        graph[name] = found
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                out.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_between_modules_or_packages():
    graph = _graph()
    assert not _cycles(graph)
    packages: dict[str, set[str]] = defaultdict(set)
    for module, imports in graph.items():
        for other in imports:
            a, b = module.split(".")[1:2], other.split(".")[1:2]
            if a and b and a != b:
                packages[a[0]].add(b[0])
    assert not _cycles(packages)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    return {id(child) for block in ast.walk(tree)
            if isinstance(block, ast.If) and getattr(block.test, "id", None) == "TYPE_CHECKING"
            for child in ast.walk(block)}


def test_project_imports_in_functions_say_why():
    """Imports sit at the top of a module; one inside a function must save start-up time (torch, the
    server's or Ray's modules for a command that does not need them), and a comment on its line or the
    line above says so ("lazy: ...")."""
    undocumented = []
    for path in sorted(PKG.rglob("*.py")):
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        top, typing_only = set(map(id, tree.body)), _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in top or id(node) in typing_only:
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if not any(n.startswith("encdec_engine") for n in names):
                continue
            if "lazy:" not in " ".join(lines[max(0, node.lineno - 2):node.end_lineno]):
                undocumented.append(f"{path.relative_to(PKG.parent)}:{node.lineno}")
    assert not undocumented, "\n".join(undocumented)


def test_imports_are_found_in_every_form():
    source = ("import encdec_engine.speech.job\n"
              "from encdec_engine import speech\n"
              "def f():\n"
              "    from encdec_engine.speech.results import Segment\n")
    found = imported_modules(ast.parse(source))
    assert {"encdec_engine.speech.job", "encdec_engine.speech", "encdec_engine.speech.results"} <= found
    assert all(is_speech(m) for m in found - {"encdec_engine"})
    assert level("encdec_engine.inputs.features") == 5 and level("encdec_engine.speech.transcriber") == 7
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_scheduler_and_block_manager_do_not_import_torch():
    """Nothing there runs torch; an annotation may name torch.Tensor (imported for type checkers only)."""
    for name in ("engine/scheduler.py", "engine/block_manager.py", "engine/sequence_group.py", "sequence.py"):
        tree = ast.parse((PKG / name).read_text())
        typing_only = _type_checking_nodes(tree)
        runtime = ast.Module(body=[n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                                   and id(n) not in typing_only], type_ignores=[])
        assert not any(m.split(".")[0] == "torch" for m in imported_modules(runtime)), name


def test_ray_is_imported_only_by_distributed_and_only_the_cli_imports_that():
    """The base install works without Ray: only encdec_engine/distributed/ imports it, and of the rest only
    the CLI (cli/ray.py and the command dispatch, which import no Ray until a Ray command runs) imports
    distributed."""
    violations = []
    for rel, name in package_imports():
        inside = rel.parts[1] == "distributed"
        if (name == "ray" or name.startswith("ray.")) and not inside:
            violations.append(f"{rel} imports {name}")
        if name.startswith("encdec_engine.distributed") and not inside and rel.parts[1] != "cli":
            violations.append(f"{rel} imports {name}")
    assert not violations, "\n".join(violations)
