"""Small fixtures made on the fly (tokenizers and random-init checkpoints: nothing downloaded) and the
helpers several test folders share."""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
MODEL_CONFIGS = ROOT / "models" / "configs"
AUDIO = ROOT / "prompts" / "audio"  # the bundled espeak-ng clips and recordings
TRANSCRIPTS = json.loads((AUDIO / "transcripts.json").read_text())
SHORT_CLIPS = sorted(n for n in TRANSCRIPTS if not n.startswith("long"))

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


def model_entry(arch: str, name: str) -> dict:
    """Entry `name` of models/configs/<arch>.json: {"seed": ..., "config": {HF config kwargs}, ...}."""
    entries = json.loads((MODEL_CONFIGS / f"{arch}.json").read_text())
    if name not in entries or name.startswith("_"):
        raise KeyError(f"models/configs/{arch}.json has no entry {name!r}; it has {sorted(entries)}")
    return entries[name]


def make_bart(dst: Path, name: str = "small", **overrides) -> Path:
    """Save a random-init BartForConditionalGeneration (+ tokenizer) of models/configs/bart.json's `name` to `dst`."""
    from transformers import BartConfig, BartForConditionalGeneration

    entry = model_entry("bart", name)
    tok = make_bart_tokenizer(dst)
    config = {"vocab_size": len(tok), **entry["config"], **overrides}
    torch.manual_seed(entry["seed"])
    model = BartForConditionalGeneration(BartConfig(**config)).eval()
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


def make_causal_lm(dst: Path, tokenizer, arch: str, name: str) -> Path:
    """Save a random-init GPT-2 or Llama (models/configs/<arch>.json's `name`) and `tokenizer` to `dst`;
    its greedy outputs vary with the input."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    config_cls, model_cls = {"gpt2": (GPT2Config, GPT2LMHeadModel), "llama": (LlamaConfig, LlamaForCausalLM)}[arch]
    entry = model_entry(arch, name)
    torch.manual_seed(entry["seed"])
    config = config_cls(**{"vocab_size": len(tokenizer), **entry["config"]})
    model = model_cls(config).eval()
    # Wide init plus random norms and positions: a narrow random model repeats one token.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "ln_" in pname or "norm" in pname:
                p.normal_(1.0 if pname.endswith("weight") else 0.0, 0.3)
            elif "wpe" in pname:
                p.normal_(0.0, 1.0)
        model.lm_head.weight[config.eos_token_id] *= entry.get("eos_boost", 1.0)
    model.save_pretrained(dst)
    tokenizer.save_pretrained(dst)
    return dst


WHISPER_TOKENIZER_FILES = ("tokenizer", "vocab", "merges", "special", "added", "normalizer")


def make_whisper(dst: Path, name: str = "tiny-80", multilingual: bool = False, seed: int | None = None,
                 **overrides) -> Path:
    """Save a random-init Whisper (models/configs/whisper.json's `name`) with tiny.en's tokenizer and
    generation config (max_length 40: random weights never stop) to `dst`."""
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    from encdec_engine.checkpoints.ct2.importer import default_model_path

    src = default_model_path()
    entry = model_entry("whisper", name)
    torch.manual_seed(entry["seed"] if seed is None else seed)
    model = WhisperForConditionalGeneration(WhisperConfig(**{**entry["config"], **overrides})).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "encoder.embed_positions" not in pname:  # keep HF's sinusoids: random ones drown the audio
                p.normal_(0, 0.5)
    model.save_pretrained(dst)
    for f in src.iterdir():
        if f.name.startswith(WHISPER_TOKENIZER_FILES):
            shutil.copy(f, dst / f.name)
    gc = GenerationConfig.from_pretrained(src)
    gc.max_length = 40  # random weights never stop: keep the tests short (HF: 40 new tokens after the prompt)
    if multilingual:
        gc.is_multilingual = True
        gc.lang_to_id = {"<|en|>": 50259, "<|de|>": 50261, "<|fr|>": 50265}
        gc.task_to_id = {"transcribe": 50359, "translate": 50358}
    gc.save_pretrained(dst)
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
    """An engine built with `tight` (a pool too small for the batch; swap_space_gb to swap), admitting
    without room held back for growth, preempts, and still gives the tokens of a roomy pool."""
    roomy = make_llm(path, num_kv_blocks=400).generate(prompts, params, use_tqdm=False)
    squeezed_llm = make_llm(path, reserve_decode_growth=False, **tight)  # vLLM's admission: growth preempts
    before = squeezed_llm.engine.scheduler.num_preemptions
    squeezed = squeezed_llm.generate(prompts, params, use_tqdm=False)
    assert squeezed_llm.engine.scheduler.num_preemptions > before, "the small pool should force preemption"
    assert [[c.token_ids for c in o.outputs] for o in squeezed] == [[c.token_ids for c in o.outputs] for o in roomy]


def norm(text: str) -> str:
    """Lowercase words without punctuation, for WER."""
    return " ".join(re.sub(r"[^a-z0-9' ]", " ", text.lower()).split())


def record_requests(engine, monkeypatch) -> list[tuple[None, dict, object]]:
    """Every (None, prompt, params) prepared by `engine` from now until monkeypatch.undo(): the offline
    `add_request` and the async engine's `process_request` both go through `process_request`."""
    added = []
    process = engine.process_request

    def recording_process(prompt, params=None):
        added.append((None, prompt, params))
        return process(prompt, params)

    monkeypatch.setattr(engine, "process_request", recording_process)
    return added


class MissingOneToken:
    """A tokenizer that has no token for one id (convert_ids_to_tokens gives None), like a tokenizer
    without Whisper's timestamp tokens; everything else is the wrapped tokenizer's."""

    def __init__(self, tokenizer, token_id: int) -> None:
        self.tokenizer, self.token_id = tokenizer, token_id

    def convert_ids_to_tokens(self, ids):
        return [None if i == self.token_id else t for i, t in zip(ids, self.tokenizer.convert_ids_to_tokens(ids))]

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def record_adds(engine, monkeypatch) -> list[tuple[str, int]]:
    """(request_id, how many requests had finished by then) for every request added to the offline `engine`
    from now until monkeypatch.undo(): which requests start together."""
    added, finished = [], []
    add, step = engine.add_request, engine.step

    def recording_add(request_id, *args):
        added.append((request_id, len(finished)))
        return add(request_id, *args)

    def recording_step():
        outs = step()
        finished.extend(o.request_id for o in outs if o.finished)
        return outs

    monkeypatch.setattr(engine, "add_request", recording_add)
    monkeypatch.setattr(engine, "step", recording_step)
    return added


class BrokenOnOneToken:
    """A tokenizer that raises (TypeError) converting one token id; everything else is the wrapped tokenizer's.
    It stands for any fault in one request's output processing."""

    def __init__(self, tokenizer, token_id: int) -> None:
        self.tokenizer, self.token_id = tokenizer, token_id

    def convert_ids_to_tokens(self, ids):
        if self.token_id in ids:
            raise TypeError(f"injected: no token for id {self.token_id}")
        return self.tokenizer.convert_ids_to_tokens(ids)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def fresh_prompts(seed: int, n: int = 8, decoder_len: int = 2) -> list[dict]:
    """Prompts no other test sends (so nothing of them is cached yet); some decoder prompts fill self blocks."""
    rng = random.Random(seed)
    return [{"encoder_prompt": {"prompt_token_ids": [0] + [rng.randrange(5, 590) for _ in range(rng.randint(6, 30))] + [2]},
             "decoder_prompt": {"prompt_token_ids": [2, 0] + [rng.randrange(5, 590) for _ in range(decoder_len)]}}
            for _ in range(n)]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def causal_prompts(vocab_size: int, n: int, seed: int) -> list:
    """Text, TextPrompt and token prompts from 1 to ~150 tokens."""
    rng = random.Random(seed)
    texts = corpus(4 * n, seed=seed + 3)
    prompts: list = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            prompts.append(" ".join(texts[4 * i : 4 * i + rng.choice([1, 2, 4])]))
        elif kind == 1:
            prompts.append({"prompt": texts[4 * i]})
        else:
            length = rng.choice([1, 2, 9, 60, 150])
            prompts.append({"prompt_token_ids": [rng.randrange(3, vocab_size) for _ in range(length)]})
    return prompts


def hf_causal_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF greedy decoding of a decoder-only model (the BART tokenizer's <pad> is 1)."""
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                             dtype=torch.long), max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                             pad_token_id=1)
    return out[0, len(prompt_ids) :].tolist()


def encdec(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """The CLI in a subprocess; by default (as openai-whisper) it writes every format into `cwd`."""
    return subprocess.run([sys.executable, "-m", "encdec_engine.cli.main", *args], capture_output=True,
                          text=True, timeout=600, cwd=cwd)
