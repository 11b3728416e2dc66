"""The Hugging Face hub: a repository already in the standard cache, or downloaded into it.

Downloads go through huggingface_hub (`snapshot_download`): into the standard cache ($HF_HOME), with a
progress bar per file, resuming a file an interrupted download left half written, and honouring
$HF_ENDPOINT, $HF_TOKEN and $HF_HUB_OFFLINE. Only what the engine reads is fetched: configs, tokenizer
files and safetensors weights (a PyTorch `.bin` only where a repository has no safetensors; a
CTranslate2 repository's `model.bin`), not the Flax, TensorFlow or ONNX copies many repos also hold.
"""

from __future__ import annotations

import os
from pathlib import Path

import huggingface_hub
from huggingface_hub import HfApi, snapshot_download, try_to_load_from_cache

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
_WANTED = ("*.json", "*.txt", "*.model", "*.spm", "*.tiktoken", "vocabulary*")


class DownloadsOff(FileNotFoundError):
    """The model is not on this machine and downloading is off (--no-download, $HF_HUB_OFFLINE)."""


def is_checkpoint(folder: Path) -> bool:
    """A Hugging Face checkpoint (config and weights) or a CTranslate2 model folder."""
    return (folder / "config.json").is_file() and (
        any((folder / f).is_file() for f in WEIGHT_FILES) or (folder / "model.bin").is_file())


def offline() -> bool:
    return bool(huggingface_hub.constants.HF_HUB_OFFLINE)


def cached(repo_id: str) -> Path | None:
    """The folder of a complete snapshot of `repo_id` in the Hugging Face cache, if there is one."""
    found = try_to_load_from_cache(repo_id, "config.json")
    if not isinstance(found, str):  # None (never fetched) or a "known not to exist" marker
        return None
    folder = Path(found).parent
    return folder if is_checkpoint(folder) else None


def download(repo_id: str) -> Path:
    """The snapshot of `repo_id`, downloading what the cache lacks (see the module docstring)."""
    files = [f.rfilename for f in HfApi().model_info(repo_id).siblings or []]
    patterns = list(_WANTED)
    if any(f.endswith(".safetensors") for f in files):
        patterns.append("*.safetensors")
    elif "model.bin" in files:  # CTranslate2
        patterns.append("model.bin")
    else:
        patterns.append("pytorch_model*.bin")
    folder = Path(snapshot_download(repo_id, allow_patterns=patterns))
    if not is_checkpoint(folder):
        raise FileNotFoundError(f"hub repository {repo_id} holds no model the engine reads (a config.json with "
                                f"safetensors or PyTorch weights, or a CTranslate2 model.bin); it has: "
                                f"{', '.join(sorted(files)[:12])}")
    return folder


def fetch(repo_id: str, name: str, allow_download: bool = True) -> Path:
    """`repo_id` from the cache, else downloaded. `name` is what the user asked for (a short name or the
    id), quoted in the errors with the command that fetches it."""
    folder = cached(repo_id)
    if folder is not None:
        return folder
    how = f"fetch it once where the network allows with: encdec download {name}"
    here = f"model {name!r} is not on this machine" + ("" if name == repo_id else f" ({repo_id} on the Hugging Face hub)")
    if not allow_download or offline():
        why = "--no-download" if not allow_download else "$HF_HUB_OFFLINE"
        raise DownloadsOff(f"{here} and downloads are off ({why}); {how}")
    try:
        return download(repo_id)
    except huggingface_hub.errors.RepositoryNotFoundError:
        endpoint = os.environ.get("HF_ENDPOINT") or "huggingface.co"
        raise FileNotFoundError(f"no repository {repo_id!r} on the Hugging Face hub ({endpoint}); check the name, "
                                "or log in for a private or gated one (hf auth login)") from None
    except FileNotFoundError:
        raise
    except Exception as e:  # no network, a proxy, the hub down: what failed, and how to fetch it
        reason = str(e).splitlines()[0] if str(e) else ""
        raise FileNotFoundError(f"{here} and could not be downloaded ({type(e).__name__}: {reason}); {how}") from None
