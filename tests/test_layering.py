"""Imports run one way: entrypoints -> llm/speech -> engine/inputs -> worker -> models -> attention/layers -> common.

The engine core (engine/, worker/, attention/, models/, layers/) is model-agnostic: it never imports the
speech pipeline (speech/), which drives the engine from above. inputs/ may use speech's audio loading and
log-mel for the audio prompt format, and nothing else of it.
"""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "encdec_engine"
LEVELS = {
    "sequence": 0, "sampling_params": 0, "outputs": 0, "config": 0, "cache": 0,
    "attention": 1, "layers": 1,
    "models": 2,
    "worker": 3,
    "engine": 4, "inputs": 4,
    "speech.audio": 4, "speech.features": 4, "speech.ffmpeg": 4,  # leaves: the audio prompt format (inputs/) converts audio with them
    "llm": 5, "speech": 5,
    "entrypoints": 6, "distributed": 6,  # distributed: batch jobs and replicated serving on Ray, beside the CLI
}
CORE = ("engine", "worker", "attention", "models", "layers")
SPEECH = "encdec_engine.speech"
SPEECH_FOR_INPUTS = {"encdec_engine.speech.audio", "encdec_engine.speech.features"}


def level(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "encdec_engine" or len(parts) < 2:
        return None
    own = LEVELS.get(".".join(parts[1:3]))  # the most specific entry: "speech.audio" before "speech"
    return own if own is not None else LEVELS.get(parts[1])


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


def test_the_engine_core_never_imports_speech():
    violations = [f"{rel} imports {name}" for rel, name in package_imports(*CORE) if is_speech(name)]
    assert not violations, "\n".join(violations)


def test_inputs_use_only_the_audio_loading_and_features_of_speech():
    violations = [f"{rel} imports {name}" for rel, name in package_imports("inputs")
                  if is_speech(name) and not any(name == m or name.startswith(m + ".") for m in SPEECH_FOR_INPUTS)]
    assert not violations, "\n".join(violations)


def test_imports_are_found_in_every_form():
    source = ("import encdec_engine.speech.job\n"
              "from encdec_engine import speech\n"
              "def f():\n"
              "    from encdec_engine.speech.results import Segment\n")
    found = imported_modules(ast.parse(source))
    assert {"encdec_engine.speech.job", "encdec_engine.speech", "encdec_engine.speech.results"} <= found
    assert all(is_speech(m) for m in found - {"encdec_engine"})
    assert level("encdec_engine.speech.features") == 4 and level("encdec_engine.speech.transcriber") == 5


def test_scheduler_and_block_manager_do_not_import_torch():
    for name in ("engine/scheduler.py", "engine/block_manager.py", "sequence.py"):
        tree = ast.parse((PKG / name).read_text())
        assert not any(m.split(".")[0] == "torch" for m in imported_modules(tree)), name


def test_ray_is_imported_only_by_distributed_and_only_the_cli_imports_that():
    """The base install works without Ray: only encdec_engine/distributed/ imports it, and of the rest only
    the CLI imports distributed (its flags module, which imports no Ray)."""
    violations = []
    for rel, name in package_imports():
        inside = rel.parts[1] == "distributed"
        if (name == "ray" or name.startswith("ray.")) and not inside:
            violations.append(f"{rel} imports {name}")
        if name.startswith("encdec_engine.distributed") and not inside and rel.parts[1:] != ("entrypoints", "cli"):
            violations.append(f"{rel} imports {name}")
    assert not violations, "\n".join(violations)
