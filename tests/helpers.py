"""Small fixtures made on the fly: tokenizers and random-init checkpoints (nothing downloaded)."""

from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import torch

WORDS = (
    "the a of and to in is was for on that with as by at from his her it an were are which this be "
    "rain spain falls mainly plain city river council report said year people government new first "
    "court police market water school team season music film world state company million percent "
    "summer winter bridge engine model request batch token cache block table memory speech audio "
    "meeting notes quickly slowly because however although before after during under over between"
).split()


def corpus(num_sentences: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(num_sentences):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 16))]
        words[0] = words[0].capitalize()
        out.append(" ".join(words) + rng.choice([".", ".", "!", "?", ", said the report."]))
    return out


def make_bart_tokenizer(dst: Path, vocab_size: int = 600):
    """A byte-level BPE tokenizer in BART's layout (<s>=0, <pad>=1, </s>=2, <unk>=3, <mask>=last)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import BartTokenizerFast

    dst.mkdir(parents=True, exist_ok=True)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus(), vocab_size=vocab_size, special_tokens=["<s>", "<pad>", "</s>", "<unk>"])
    bpe.save_model(str(dst))
    # transformers v5 takes the vocab and merges themselves (v4 took file names).
    tok = BartTokenizerFast(vocab=str(dst / "vocab.json"), merges=str(dst / "merges.txt"))
    tok.add_special_tokens({"mask_token": "<mask>"})
    tok.save_pretrained(dst)
    assert len(tok) > 256, f"tokenizer has only {len(tok)} tokens"
    return tok


def make_bart(dst: Path, seed: int = 0, **config) -> Path:
    """Save a random-init BartForConditionalGeneration (+ tokenizer) to `dst`."""
    from transformers import BartConfig, BartForConditionalGeneration

    tok = make_bart_tokenizer(dst)
    defaults = dict(
        vocab_size=len(tok), d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=256,
        init_std=1.0, forced_eos_token_id=None, dropout=0.0,
    )
    defaults.update(config)
    torch.manual_seed(seed)
    model = BartForConditionalGeneration(BartConfig(**defaults)).eval()
    # Wide init, random positions, a random logits bias and layer norms make a random
    # model's outputs vary with its input instead of repeating one token.
    with torch.no_grad():
        model.final_logits_bias.normal_(0, 0.5)
        model.model.decoder.embed_positions.weight.normal_(0, 1.0)
        for name, p in model.named_parameters():
            if "layer_norm" in name or "layernorm" in name:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.3)
    model.save_pretrained(dst)
    return dst


def hf_greedy(model, encoder_ids: list[int], decoder_ids: list[int], max_new_tokens: int, **processors) -> list[int]:
    """Tokens HF `generate` adds after `decoder_ids` (greedy, no processors unless given)."""
    kwargs = dict(do_sample=False, num_beams=1, forced_eos_token_id=None, forced_bos_token_id=None, min_length=0,
                  no_repeat_ngram_size=0, repetition_penalty=1.0)
    kwargs.update(processors)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([encoder_ids]), decoder_input_ids=torch.tensor([decoder_ids]),
                             attention_mask=torch.ones(1, len(encoder_ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, **kwargs)
    return out[0, len(decoder_ids):].tolist()


def mixed_prompts(tokenizer, n: int = 14, seed: int = 0) -> list:
    """Every prompt format, very different encoder and decoder lengths."""
    rng = random.Random(seed)
    texts = corpus(4 * n, seed=seed + 7)
    prompts = []
    for i in range(n):
        doc = " ".join(texts[4 * i : 4 * i + rng.choice([1, 1, 2, 4])])
        if i % 7 == 6:
            doc = doc.split()[0]  # a one-word document
        ids = tokenizer(doc)["input_ids"]
        kind = i % 6
        if kind == 0:
            prompts.append(doc)
        elif kind == 1:
            prompts.append({"prompt": doc})
        elif kind == 2:
            prompts.append({"prompt_token_ids": ids})
        elif kind == 3:
            prompts.append({"encoder_prompt": doc, "decoder_prompt": None})
        elif kind == 4:
            dec = " ".join(texts[4 * i + 1].split()[: rng.randint(1, 12)])
            prompts.append({"encoder_prompt": {"prompt": doc}, "decoder_prompt": dec})
        else:
            dec = [2, 0] + [rng.randrange(5, len(tokenizer) - 1) for _ in range(rng.randint(8, 18))]
            prompts.append({"encoder_prompt": {"prompt_token_ids": ids}, "decoder_prompt": {"prompt_token_ids": dec}})
    return prompts


def make_view(q_lens, k_lens, causal: bool, **kw):
    """An AttentionView over a flat batch with these query and key lengths."""
    from encdec_engine.attention.metadata import AttentionView

    return AttentionView.from_arrays(np.concatenate([[0], np.cumsum(q_lens)]), k_lens, causal, **kw)


def naive_attention(q, k, v, scale, mask=None):
    """q: [T, H, D], k/v: [Tk, Hkv, D], mask: [T, Tk] additive; fp64 for a clean reference."""
    rep = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = torch.einsum("thd,khd->htk", q, k) * scale
    if mask is not None:
        scores = scores + mask.double()
    return torch.einsum("htk,khd->thd", scores.softmax(-1), v)


def assert_preemption_keeps_outputs(make_llm, path, prompts, params, **tight) -> None:
    """An engine built with `tight` (a pool too small for the batch; swap_space_gb to swap) preempts,
    and still gives the tokens of a roomy pool."""
    roomy = make_llm(path, num_kv_blocks=400).generate(prompts, params, use_tqdm=False)
    squeezed_llm = make_llm(path, **tight)
    before = squeezed_llm.engine.scheduler.num_preemptions
    squeezed = squeezed_llm.generate(prompts, params, use_tqdm=False)
    assert squeezed_llm.engine.scheduler.num_preemptions > before, "the small pool should force preemption"
    assert [[c.token_ids for c in o.outputs] for o in squeezed] == [[c.token_ids for c in o.outputs] for o in roomy]


def norm(text: str) -> str:
    """Lowercase words without punctuation, for WER."""
    return " ".join(re.sub(r"[^a-z0-9' ]", " ", text.lower()).split())


def record_requests(engine, monkeypatch) -> list[tuple[str, dict, object]]:
    """Every (request_id, prompt, params) added to `engine` from now until monkeypatch.undo()."""
    added = []
    add = engine.add_request

    def recording_add(request_id, prompt, params=None, *args):
        added.append((request_id, prompt, params))
        return add(request_id, prompt, params, *args)

    monkeypatch.setattr(engine, "add_request", recording_add)
    return added

