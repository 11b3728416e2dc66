"""`encdec translate FILE... --to LANG [--from LANG]`: text files translated line by line.

Each non-empty line is one text (blank lines stay blank), all files' lines run as one batch, and each
file's translation is printed (`== FILE` before each when there are several) or written to
`--output-dir/<file stem>.<LANG>.txt`. The languages are told the model its family's way
(translation/conventions.py); decoding follows the checkpoint's generation config.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from encdec_engine.cli.args import HelpFormatter, add_engine_args, check_engine_args, load_llm, make_output_dir
from encdec_engine.files import write_atomically
from encdec_engine.inputs.documents import MAX_DOCUMENT_BYTES, read_document


def add_translate_parser(sub) -> None:
    p = sub.add_parser("translate", help="translate text files line by line (T5, Marian, mBART-50, M2M100, NLLB)",
                       formatter_class=HelpFormatter)
    p.add_argument("files", nargs="+", help="UTF-8 text files; each non-empty line is translated")
    p.add_argument("--to", dest="target", required=True,
                   help="target language: ISO 639-1 or 639-3 code, English name, or the model's own code "
                        "(de, deu, German, de_DE, deu_Latn)")
    p.add_argument("--from", dest="source", default=None,
                   help="source language (default: English where the model needs one; Marian's is its own)")
    add_engine_args(p)
    p.add_argument("--max-tokens", type=int, default=None,
                   help="tokens per translated line at most (default: the checkpoint's generation config)")
    p.add_argument("--num-beams", type=int, default=None, help="beam width (default: the checkpoint's)")
    p.add_argument("--output-dir", "-o", default=None,
                   help="write <file stem>.<to>.txt per file here instead of printing")
    p.add_argument("--max-document-bytes", type=int, default=MAX_DOCUMENT_BYTES,
                   help="a file larger than this is refused before it is read")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_translate)


def cmd_translate(args: argparse.Namespace) -> int:
    documents = [read_document(name, args.max_document_bytes) for name in args.files]  # ValueError: exit 2
    outputs = [_output_path(args, name) for name in args.files]
    if args.output_dir is not None and len(set(outputs)) != len(outputs):
        raise ValueError("two inputs would write the same translation file; give files of different names")
    check_engine_args(args)
    if args.output_dir is not None:
        make_output_dir(args.output_dir)
    llm = load_llm(args)
    lines = [doc.splitlines() for doc in documents]
    texts = [line for doc in lines for line in doc if line.strip()]
    where = [f"{name}:{n}" for name, doc in zip(args.files, lines) for n, line in enumerate(doc, 1) if line.strip()]
    overrides = {k: v for k, v in (("max_tokens", args.max_tokens), ("num_beams", args.num_beams)) if v is not None}
    try:
        translated = iter(llm.translate(texts, args.source, args.target, use_tqdm=not args.quiet, **overrides))
    except ValueError as e:  # "text 3: ..." -> the file and line it came from
        found = re.match(r"text (\d+): (.*)", str(e), re.S)
        raise (ValueError(f"{where[int(found[1])]}: {found[2]}") if found else e) from None
    for name, doc, output in zip(args.files, lines, outputs):
        text = "\n".join(next(translated) if line.strip() else line for line in doc) + "\n"
        if output is not None:
            write_atomically(output, text)
        elif len(args.files) > 1:
            print(f"== {name}\n{text}", end="")
        else:
            print(text, end="")
    return 0


def _output_path(args: argparse.Namespace, name: str) -> Path | None:
    if args.output_dir is None:
        return None
    return Path(args.output_dir) / f"{Path(name).stem}.{args.target}.txt"
