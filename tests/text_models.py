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
    """NLLB-200's layout: sentencepiece.bpe.model, its 202 language codes listed in tokenizer_config.json."""
    from transformers.models.nllb.tokenization_nllb import FAIRSEQ_LANGUAGE_CODES

    fairseq_bpe_model(dst)
    _write_json(dst / "tokenizer_config.json", {"tokenizer_class": "NllbTokenizer", "src_lang": "eng_Latn",
                                                 "additional_special_tokens": list(FAIRSEQ_LANGUAGE_CODES)})
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


# -- random-init checkpoints -----------------------------------------------------------------------------

def _tokenizer(dst: Path, kind: str, hub_layout: bool, **kw):
    """The family's tokenizer in `dst`: its hub files as they are (`hub_layout`), or what transformers'
    `save_pretrained` writes after reading them."""
    files = TOKENIZER_FILES[kind](dst / "_hub_tokenizer", **kw)
    tok = load_hf_tokenizer(files)
    if hub_layout:
        for f in files.iterdir():
            shutil.copy(f, dst / f.name)
    else:
        tok.save_pretrained(dst)
    shutil.rmtree(files)
    return tok


def _randomize(model, entry: dict) -> None:
    """Wide random norms, biases and position tables: a narrow random model's greedy output varies with
    its input instead of repeating one token."""
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.normal_(1.0 if pname.endswith("weight") else 0.0, 0.3)
            elif "relative_attention_bias" in pname or "embed_positions" in pname:
                p.normal_(0.0, 1.0)
            elif pname.endswith("bias"):
                p.normal_(0.0, 0.2)
            elif entry.get("embed_std") and ("shared" in pname or "embed_tokens" in pname or "lm_head" in pname):
                p.normal_(0.0, entry["embed_std"])  # sinusoidal positions (amplitude 1) must not drown
            elif entry.get("weight_std") and pname.endswith("weight"):
                p.normal_(0.0, entry["weight_std"])
        if getattr(model, "final_logits_bias", None) is not None:
            model.final_logits_bias.normal_(0, entry.get("logits_bias_std", 0.5))


def make_t5(dst: Path, name: str = "small", hub_layout: bool = False, **overrides) -> Path:
    """A random-init T5 / mT5 (models/configs/t5.json's `name`) and its SentencePiece tokenizer."""
    from transformers import MT5Config, MT5ForConditionalGeneration, T5Config, T5ForConditionalGeneration

    entry = model_entry("t5", name)
    dst.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(dst, "t5", hub_layout)
    config_cls, model_cls = {"t5": (T5Config, T5ForConditionalGeneration),
                             "mt5": (MT5Config, MT5ForConditionalGeneration)}[entry["model_type"]]
    config = config_cls(**{"vocab_size": len(tok), "decoder_start_token_id": 0, **entry["config"], **overrides})
    torch.manual_seed(entry["seed"])
    model = model_cls(config).eval()
    _randomize(model, {"weight_std": 0.5})
    if not entry["config"].get("tie_word_embeddings", True):
        # transformers 5 ties T5's head in memory; an untied head is saved as its own tensor when it differs
        model.lm_head.weight = torch.nn.Parameter(torch.randn(len(tok), config.d_model) * 0.5)
    model.save_pretrained(dst)
    return dst


def make_bart_family(dst: Path, arch: str, name: str = "small", hub_layout: bool = False, **overrides) -> Path:
    """A random-init mBART-50, Marian or M2M100 / NLLB (models/configs/<arch>.json's `name`) and its tokenizer."""
    from transformers import (M2M100Config, M2M100ForConditionalGeneration, MarianConfig, MarianMTModel, MBartConfig,
                              MBartForConditionalGeneration)

    entry = model_entry(arch, name)
    dst.mkdir(parents=True, exist_ok=True)
    if arch == "marian":
        tok = _tokenizer(dst, "marian", hub_layout, target_languages=tuple(entry.get("target_languages", ())))
        ids = dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                   decoder_start_token_id=tok.pad_token_id, forced_eos_token_id=tok.eos_token_id)
        config_cls, model_cls = MarianConfig, MarianMTModel
    elif arch == "mbart":
        tok = _tokenizer(dst, "mbart", hub_layout)
        ids = dict(vocab_size=len(tok))
        config_cls, model_cls = MBartConfig, MBartForConditionalGeneration
    else:
        kind = entry.get("tokenizer", "m2m100")
        tok = _tokenizer(dst, kind, hub_layout)
        size = len(tok) if kind == "nllb" else tok.encoder_size + len(tok.lang_code_to_id) + tok.num_madeup_words
        ids = dict(vocab_size=size, decoder_start_token_id=2)
        config_cls, model_cls = M2M100Config, M2M100ForConditionalGeneration
    config = config_cls(**{**ids, **entry["config"], **overrides})
    torch.manual_seed(entry["seed"])
    model = model_cls(config).eval()
    _randomize(model, entry)
    model.save_pretrained(dst)
    return dst
