"""Imports run one way: entrypoints -> llm -> engine/inputs -> worker -> models -> attention/layers -> common."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "encdec_engine"
LEVELS = {
    "sequence": 0, "sampling_params": 0, "outputs": 0, "config": 0,
    "attention": 1, "layers": 1,
    "models": 2,
    "worker": 3,
    "engine": 4, "inputs": 4,
    "llm": 5, "transcription": 5,
    "entrypoints": 6,
}


def level(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "encdec_engine" or len(parts) < 2:
        return None
    return LEVELS.get(parts[1])


def test_no_module_imports_from_a_layer_above_it():
    violations = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        own = level(".".join(rel.parts))
        if own is None:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                other = level(name)
                if other is not None and other > own:
                    violations.append(f"{rel} imports {name}")
    assert not violations, "\n".join(violations)


def test_scheduler_and_block_manager_do_not_import_torch():
    for name in ("engine/scheduler.py", "engine/block_manager.py", "sequence.py"):
        tree = ast.parse((PKG / name).read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not any(m.split(".")[0] == "torch" for m in imported), name
