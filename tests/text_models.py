"""Random-init checkpoints of the encoder/decoder text family (T5, mT5, mBART-50, Marian, M2M100, NLLB)
with tokenizers trained here on tiny corpora, in the layouts `save_pretrained` writes and in the hub's
SentencePiece-only layouts. Nothing is downloaded."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch

from helpers import corpus, model_entry

# A second, made-up "language" with multi-byte characters: the target side of the translation models.
TARGET_WORDS = (
    "der die das und ist war für auf mit von zu im eine einer über unter während nach vor weil jedoch "
    "Regen Spanien fällt hauptsächlich Ebene Stadt Fluss Rat Bericht sagte Jahr Leute Regierung neue erste "
    "Gericht Polizei Markt Wasser Schule Mannschaft Saison Musik Film Welt Staat Firma Million Prozent Sommer "
    "Winter Brücke Maschine Anfrage Stapel Zeichen Speicher Block Tabelle Sprache Straße größer schön Café "
    "déjà naïve façade Ärger Öl Übung"
).split()


def target_corpus(num_sentences: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(num_sentences):
        words = [rng.choice(TARGET_WORDS) for _ in range(rng.randint(4, 14))]
        out.append(" ".join(words).capitalize() + rng.choice([".", "!", "?"]))
    return out


def train_spm(dst: Path, lines: list[str], vocab_size: int, model_type: str, **ids) -> Path:
    """A SentencePiece model at `dst` (its .model file) trained on `lines`."""
    import sentencepiece as spm

    dst.parent.mkdir(parents=True, exist_ok=True)
    text = dst.parent / f"{dst.stem}.corpus.txt"
    text.write_text("\n".join(lines), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(dst.with_suffix("")), vocab_size=vocab_size,
                                   hard_vocab_limit=False, model_type=model_type, character_coverage=1.0,
                                   minloglevel=2, **ids)
    text.unlink()
    dst.with_suffix(".vocab").unlink()
    if dst.suffix != ".model":
        dst.with_suffix(".model").rename(dst)
    return dst


def _write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value, indent=1, ensure_ascii=False), encoding="utf-8")


# -- tokenizers in the hub's layouts ---------------------------------------------------------------------

def t5_tokenizer_files(dst: Path, extra_ids: int = 10) -> Path:
    """The hub layout of a T5 tokenizer: spiece.model (unigram; <pad>=0, </s>=1, <unk>=2) and its config."""
    train_spm(dst / "spiece.model", corpus(2000, seed=1) + target_corpus(500, seed=1), 300, "unigram",
              pad_id=0, eos_id=1, unk_id=2, bos_id=-1, pad_piece="<pad>", eos_piece="</s>", unk_piece="<unk>")
    _write_json(dst / "tokenizer_config.json", {"tokenizer_class": "T5Tokenizer", "extra_ids": extra_ids,
                                                 "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"})
    return dst


def marian_tokenizer_files(dst: Path, target_languages: tuple[str, ...] = (), source_lang: str = "en",
                           target_lang: str = "de") -> Path:
    """The hub layout of a Marian tokenizer: source.spm and target.spm (unigram) and one vocab.json over both
    (</s>=0, <unk>=1, ..., <pad> last), with >>xx<< target tokens for a multilingual target side."""
    train_spm(dst / "source.spm", corpus(2000, seed=2), 300, "unigram", unk_id=1, eos_id=0, bos_id=-1, pad_id=-1)
    train_spm(dst / "target.spm", target_corpus(2000, seed=2), 300, "unigram", unk_id=1, eos_id=0, bos_id=-1,
              pad_id=-1)
    import sentencepiece as spm

    vocab = {"</s>": 0, "<unk>": 1}
    for code in target_languages:
        vocab[f">>{code}<<"] = len(vocab)
    for name in ("source.spm", "target.spm"):
        sp = spm.SentencePieceProcessor(model_file=str(dst / name))
        for i in range(sp.get_piece_size()):
            vocab.setdefault(sp.id_to_piece(i), len(vocab))
    vocab["<pad>"] = len(vocab)
    _write_json(dst / "vocab.json", vocab)
    _write_json(dst / "tokenizer_config.json", {"tokenizer_class": "MarianTokenizer", "source_lang": source_lang,
                                                 "target_lang": target_lang, "model_max_length": 512,
                                                 "separate_vocabs": False})
    return dst


def fairseq_bpe_model(dst: Path) -> Path:
    """sentencepiece.bpe.model as fairseq's multilingual models ship it (<unk>=0, <s>=1, </s>=2)."""
    return train_spm(dst / "sentencepiece.bpe.model", corpus(2000, seed=3) + target_corpus(2000, seed=3), 320,
                     "bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1)


def mbart50_tokenizer_files(dst: Path) -> Path:
    fairseq_bpe_model(dst)
    _write_json(dst / "tokenizer_config.json", {"tokenizer_class": "MBart50Tokenizer", "src_lang": "en_XX",
                                                 "tgt_lang": "ro_RO"})
    return dst


def nllb_tokenizer_files(dst: Path) -> Path:
    fairseq_bpe_model(dst)
    _write_json(dst / "tokenizer_config.json", {"tokenizer_class": "NllbTokenizer", "src_lang": "eng_Latn"})
    return dst


def m2m100_tokenizer_files(dst: Path) -> Path:
    """M2M100's hub layout: sentencepiece.bpe.model and fairseq's dictionary as vocab.json."""
    import sentencepiece as spm

    fairseq_bpe_model(dst)
    sp = spm.SentencePieceProcessor(model_file=str(dst / "sentencepiece.bpe.model"))
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for i in range(3, sp.get_piece_size()):
        vocab.setdefault(sp.id_to_piece(i), len(vocab))
    _write_json(dst / "vocab.json", vocab)
    _write_json(dst / "tokenizer_config.json", {"tokenizer_class": "M2M100Tokenizer", "src_lang": "en",
                                                 "num_madeup_words": 8})
    return dst


TOKENIZER_FILES = {"t5": t5_tokenizer_files, "mt5": t5_tokenizer_files, "marian": marian_tokenizer_files,
                   "mbart": mbart50_tokenizer_files, "m2m100": m2m100_tokenizer_files,
                   "nllb": nllb_tokenizer_files}


def load_hf_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)
