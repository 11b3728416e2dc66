"""A model cache shared by several users (docs/ray.md, "A cache for several users"), tried with two real
uids: one owner imports the default model into a sticky shared folder (mode 1777, as /tmp), another
user reads it in place, and nobody loads a kernel library from a folder another user could write.

Before: the import was written as 0700 folders and 0600 files, so the second user could not read it,
re-imported beside a 148 MB `.stale` folder it could not delete, and in a sticky folder failed outright
(`Operation not permitted ... -> ....stale`); the kernel was loaded from any `kernels/` folder."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

OWNER, OTHER = 4242, 4343  # uids no account uses

pytestmark = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="needs root and setpriv to act as two users")


def run_as(uid: int, home: Path, cache: Path, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(home), "ENCDEC_CACHE": str(cache)}
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable, "-c", code],
                          env=env, capture_output=True, text=True, timeout=300, cwd=home)


@pytest.fixture(scope="module")
def machine():
    """/tmp/<base> (0755) with a sticky shared folder and a home for each user."""
    base = Path(tempfile.mkdtemp(prefix="encdec-users-", dir="/tmp"))
    base.chmod(0o755)
    shared = base / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    homes = {}
    for uid in (OWNER, OTHER):
        homes[uid] = base / f"home-{uid}"
        homes[uid].mkdir()
        os.chown(homes[uid], uid, uid)
    probe = run_as(OTHER, homes[OTHER], shared, "import encdec_engine")
    if probe.returncode:
        shutil.rmtree(base)
        pytest.skip(f"another uid cannot run this interpreter and package: {probe.stderr.strip()[-300:]}")
    yield shared, homes
    shutil.rmtree(base)


IMPORT = "from encdec_engine.checkpoints.ct2.importer import default_model_path; print(default_model_path())"


def test_one_user_imports_and_another_reads_it_in_place(machine):
    shared, homes = machine
    owner = run_as(OWNER, homes[OWNER], shared, IMPORT)
    assert owner.returncode == 0, owner.stderr
    model = Path(owner.stdout.split()[-1])
    assert model == shared / "whisper-tiny.en" and model.stat().st_uid == OWNER
    for path in [model, *model.iterdir()]:  # the umask's modes (022 here), not mkdtemp's 0700 / mkstemp's 0600
        assert stat.S_IMODE(path.stat().st_mode) & 0o044 == 0o044, path
    marker = model / ".encdec-import.json"
    stamp = marker.stat().st_mtime_ns

    other = run_as(OTHER, homes[OTHER], shared, IMPORT + "\nimport json, transformers; transformers.AutoConfig"
                                                        ".from_pretrained(default_model_path())")
    assert other.returncode == 0, other.stderr
    assert Path(other.stdout.split()[-1]) == model
    assert marker.stat().st_mtime_ns == stamp  # read, not imported again
    assert sorted(p.name for p in shared.iterdir()) == ["whisper-tiny.en"]  # no .stale, no temporary folder


def test_an_outdated_import_of_another_user_is_refused_by_name(machine):
    shared, homes = machine
    model = shared / "whisper-tiny.en"
    if not model.exists():
        assert run_as(OWNER, homes[OWNER], shared, IMPORT).returncode == 0
    marker = model / ".encdec-import.json"
    current = marker.read_text()
    marker.write_text(json.dumps({**json.loads(current), "importer": 0}))  # made by an older engine
    try:
        other = run_as(OTHER, homes[OTHER], shared, IMPORT)
        assert other.returncode != 0
        assert f"{model} holds an import made by uid {OWNER}" in other.stderr and "ask its owner" in other.stderr
        assert sorted(p.name for p in shared.iterdir()) == ["whisper-tiny.en"]
    finally:
        marker.write_text(current)


def test_a_user_of_the_shared_models_keeps_its_kernel_in_a_cache_of_its_own(machine):
    """The kernel folder in the shared cache is the owner's: another user pointing ENCDEC_CACHE there is
    told why it gets no kernel; pointing --model-dir there instead, it reads the models and builds its own."""
    shared, homes = machine
    kernel = ("import logging; logging.basicConfig(level=logging.INFO)\n"
              "from encdec_engine.attention.ops import cpu_decode; print(cpu_decode.load() is not None)")
    owner = run_as(OWNER, homes[OWNER], shared, kernel)
    assert owner.returncode == 0 and owner.stdout.split()[-1] == "True", owner.stderr
    other = run_as(OTHER, homes[OTHER], shared, kernel)
    assert other.returncode == 0 and other.stdout.split()[-1] == "False"
    assert f"belongs to uid {OWNER}, not to this user (uid {OTHER})" in other.stderr
    assert "ENCDEC_CACHE" in other.stderr

    own = homes[OTHER] / "cache"
    code = (f"from encdec_engine.checkpoints.names import resolve; print(resolve('tiny.en', model_dir={str(shared)!r}))\n"
            + kernel)
    other = run_as(OTHER, homes[OTHER], own, code)
    assert other.returncode == 0, other.stderr
    assert other.stdout.split()[-2:] == [str(shared / "whisper-tiny.en"), "True"]
    assert (own / "kernels").stat().st_uid == OTHER
