"""server/routes.py: every path the server answers is written there once, and the app, the gate, the
metrics and the OpenAPI document read it (a path was written in four files)."""

import ast
from pathlib import Path

from helpers import make_bart

from encdec_engine.server import routes
from encdec_engine.server.app import build_app

SERVER = Path(routes.__file__).parent
PATHS = {value for name, value in vars(routes).items() if name.isupper() and isinstance(value, str)}


def test_the_app_answers_exactly_the_paths_of_the_route_table(tmp_path):
    app = build_app(str(make_bart(tmp_path / "bart")), num_kv_blocks=16)
    served = {route.path for route in _flat(app.routes)}
    assert served == PATHS - {routes.API_PREFIX}
    documented = set(app.openapi()["paths"])  # a text model's: no audio endpoints
    assert documented == {routes.COMPLETIONS, routes.MODELS, routes.MODEL.replace(":path", ""), routes.HEALTH,
                          routes.METRICS}


def _flat(entries):
    """The routes, those of included routers too (FastAPI keeps an included router as one entry)."""
    for entry in entries:
        router = getattr(entry, "original_router", None)
        yield from _flat(router.routes) if router is not None else [entry]


def test_no_server_module_writes_a_path_of_its_own():
    """A string constant (docstrings aside) that is a served path, or starts with /v1, belongs in routes.py."""
    found = []
    for path in sorted(SERVER.glob("*.py")):
        if path.name == "routes.py":
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                    and (node.value in PATHS or node.value.startswith(routes.API_PREFIX + "/"))):
                found.append(f"{path.name}:{node.lineno} {node.value!r}")
    assert not found, "\n".join(found)


def test_an_app_dropped_frees_its_engine(tmp_path):
    """No route holds its app by closure: FastAPI caches endpoint functions for the process, and /docs'
    closure over `app` kept every app built (and its engine: weights and KV pool) alive."""
    import gc
    import weakref

    from fastapi.testclient import TestClient

    app = build_app(str(make_bart(tmp_path / "bart")), num_kv_blocks=16)
    with TestClient(app, base_url="http://localhost") as client:
        assert client.get(routes.DOCS).status_code == 200
    engine = weakref.ref(app.state.server.engine.engine)
    del app, client
    gc.collect()
    assert engine() is None
