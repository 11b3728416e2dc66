"""Tied weights as transformers 5 ties them, one parity test per rule (docs/models.md, "Tied weights").

transformers 5 ties nothing unless `config.tie_word_embeddings` is set; then it ties each model's
pairs (Marian's depend on `share_encoder_decoder_embeddings`), and at `from_pretrained` a pair whose
two tensors are both in the checkpoint with different values stays untied (with a warning), a pair
with one of them missing takes the other. `tie_encoder_decoder` is gone: a config that sets it ties
nothing more. Each case builds a tiny random-init model, makes the weights the rule is about really
differ (in the model, or by editing the saved checkpoint as other writers leave it), and checks the
engine's greedy tokens against HF `generate`, token for token.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import hf_causal_greedy, hf_greedy, make_whisper, model_entry
from safetensors.torch import load_file, save_file

from encdec_engine import SamplingParams

VOCAB = 96  # the text models' vocabulary (no tokenizer: token prompts)
MAX_TOKENS = 10
PROMPT_LENGTHS = (2, 7, 19, 40)


def _randomize(model) -> None:
    """Wide random weights (a narrow random model repeats one token), each untied tensor its own."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.3)
            elif name.endswith("bias") or "relative_attention_bias" in name or "embed_positions" in name:
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.5 if ("embed" in name or "shared" in name or "lm_head" in name or "wte" in name
                                       or "proj_out" in name) else 1.0)
        if getattr(model, "final_logits_bias", None) is not None:
            model.final_logits_bias.normal_(0.0, 0.3)


def _edit_weights(folder: Path, changes: dict[str, Callable[[dict], torch.Tensor | None]]) -> None:
    """Rewrite model.safetensors: each change gives a tensor's new value from all the tensors, or None to
    drop it (in order: a later change sees the earlier ones)."""
    file = folder / "model.safetensors"
    weights = load_file(file)
    for name, change in changes.items():
        value = change(weights)
        if value is None:
            weights.pop(name)
        else:
            weights[name] = value.contiguous()
    save_file(weights, file, metadata={"format": "pt"})


def _differs(base: str, seed: int) -> Callable[[dict], torch.Tensor]:
    """A copy of checkpoint tensor `base` moved by noise: the same shape, other values."""
    def change(weights: dict) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return weights[base] + 0.5 * torch.randn(weights[base].shape, generator=g)
    return change


def _all_differ(folder: Path, *names: str) -> None:
    """The case tests what it says: these checkpoint tensors are all there and pairwise different."""
    weights = load_file(folder / "model.safetensors")
    tensors = [weights[n] for n in names]
    for i, a in enumerate(tensors):
        for b in tensors[i + 1 :]:
            assert a.shape != b.shape or not torch.equal(a, b)


# -- the models: each returns (HF class, config) -----------------------------------------------------

def _family(arch: str, **overrides):
    from transformers import (BartConfig, BartForConditionalGeneration, M2M100Config, M2M100ForConditionalGeneration,
                              MarianConfig, MarianMTModel, MBartConfig, MBartForConditionalGeneration)

    config_cls, model_cls, entry = {
        "bart": (BartConfig, BartForConditionalGeneration, "small"),
        "mbart": (MBartConfig, MBartForConditionalGeneration, "small"),
        "m2m100": (M2M100Config, M2M100ForConditionalGeneration, "small"),
        "marian": (MarianConfig, MarianMTModel, "small"),
    }[arch]
    ids = dict(bos_token_id=0, pad_token_id=1, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)
    if arch == "marian":
        ids.update(eos_token_id=0, decoder_start_token_id=1, bos_token_id=None)
    return model_cls, config_cls(**{**model_entry(arch, entry)["config"], "vocab_size": VOCAB, **ids, **overrides})


def _t5(model_type: str = "t5", **overrides):
    from transformers import MT5Config, MT5ForConditionalGeneration, T5Config, T5ForConditionalGeneration

    config_cls, model_cls = {"t5": (T5Config, T5ForConditionalGeneration),
                             "mt5": (MT5Config, MT5ForConditionalGeneration)}[model_type]
    config = {**model_entry("t5", "small")["config"], "vocab_size": VOCAB, "decoder_start_token_id": 0,
              "pad_token_id": 0, "eos_token_id": 1, **overrides}
    return model_cls, config_cls(**config)


def _causal(arch: str, **overrides):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    config_cls, model_cls, entry = {"gpt2": (GPT2Config, GPT2LMHeadModel, "tiny"),
                                    "llama": (LlamaConfig, LlamaForCausalLM, "gqa")}[arch]
    return model_cls, config_cls(**{**model_entry(arch, entry)["config"], "vocab_size": VOCAB, **overrides})


def _own_head(model) -> None:
    """transformers 5 ties T5's head in memory whatever the config says; a head of its own (v1.1, Flan,
    mT5 as the hub holds them) is a new tensor, which save_pretrained then writes."""
    model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight) * 0.5)


# name -> (model maker, in-memory change or None, checkpoint edits, tensors that must differ)
TEXT_CASES = {
    # tie_word_embeddings=False: nothing tied, every embedding and the head their own
    "bart_untied": (lambda: _family("bart", tie_word_embeddings=False), None, {},
                    ("model.shared.weight", "model.encoder.embed_tokens.weight",
                     "model.decoder.embed_tokens.weight", "lm_head.weight")),
    "mbart_untied": (lambda: _family("mbart", tie_word_embeddings=False), None, {},
                     ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight")),
    "m2m100_untied": (lambda: _family("m2m100", tie_word_embeddings=False), None, {},
                      ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight")),
    # issue 49: share_encoder_decoder_embeddings (the default) does not tie when tie_word_embeddings is off
    "marian_untied": (lambda: _family("marian", tie_word_embeddings=False), None, {},
                      ("model.shared.weight", "model.encoder.embed_tokens.weight",
                       "model.decoder.embed_tokens.weight", "lm_head.weight")),
    # separate encoder and decoder vocabularies: the head tied to the decoder's embedding of decoder_vocab_size
    "marian_separate_vocab": (lambda: _family("marian", share_encoder_decoder_embeddings=False,
                                              decoder_vocab_size=VOCAB - 27), None, {},
                              ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight")),
    "marian_separate_vocab_untied": (lambda: _family("marian", share_encoder_decoder_embeddings=False,
                                                     decoder_vocab_size=VOCAB - 27, tie_word_embeddings=False),
                                     None, {}, ("model.encoder.embed_tokens.weight",
                                                "model.decoder.embed_tokens.weight", "lm_head.weight")),
    # the config ties, the checkpoint holds different tensors: HF leaves that pair untied
    "bart_tied_head_differs": (lambda: _family("bart"), None,
                               {"lm_head.weight": _differs("model.shared.weight", 1)},
                               ("model.shared.weight", "lm_head.weight")),
    "mbart_tied_encoder_embedding_differs": (lambda: _family("mbart"), None,
                                             {"model.encoder.embed_tokens.weight": _differs("model.shared.weight", 2)},
                                             ("model.shared.weight", "model.encoder.embed_tokens.weight")),
    # ... the decoder reads its own embedding while the head stays the shared one
    "m2m100_tied_decoder_embedding_differs": (lambda: _family("m2m100"), None,
                                              {"model.decoder.embed_tokens.weight":
                                               _differs("model.shared.weight", 3)},
                                              ("model.shared.weight", "model.decoder.embed_tokens.weight")),
    "marian_tied_head_differs": (lambda: _family("marian"), None,
                                 {"lm_head.weight": _differs("model.shared.weight", 4)},
                                 ("model.shared.weight", "lm_head.weight")),
    # the source of the ties missing: the one tensor there is everyone's (HF swaps source and target)
    "bart_tied_only_encoder_embedding": (lambda: _family("bart"), None,
                                         {"model.encoder.embed_tokens.weight": lambda w: w["model.shared.weight"],
                                          "model.shared.weight": lambda w: None}, ()),
    # T5: always tied in transformers 5 (the config forces tie_word_embeddings); tie_word_embeddings=False
    # in a saved config only turns off the d_model**-0.5 scaling of the decoder output (v1.1, Flan)
    "t5_v1_1_own_head": (lambda: _t5(tie_word_embeddings=False, feed_forward_proj="gated-gelu"), _own_head, {},
                         ("shared.weight", "lm_head.weight")),
    "t5_v1_1_tied_head_not_scaled": (lambda: _t5(tie_word_embeddings=False), None, {}, ()),
    "t5_own_head_scaled": (lambda: _t5(), _own_head, {}, ("shared.weight", "lm_head.weight")),
    "t5_embeddings_differ": (lambda: _t5(), None,
                             {"encoder.embed_tokens.weight": _differs("shared.weight", 5),
                              "decoder.embed_tokens.weight": _differs("shared.weight", 6)},
                             ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")),
    "mt5_tied_head_not_scaled": (lambda: _t5("mt5", tie_word_embeddings=False), None, {}, ()),
    # transformers 5 has no tie_encoder_decoder: the encoder and decoder keep their own layers
    "t5_tie_encoder_decoder_ignored": (lambda: _t5(tie_encoder_decoder=True), None, {},
                                       ("encoder.block.0.layer.0.SelfAttention.q.weight",
                                        "decoder.block.0.layer.0.SelfAttention.q.weight")),
    # decoder-only: lm_head tied to the token embedding
    "gpt2_untied": (lambda: _causal("gpt2", tie_word_embeddings=False), None, {},
                    ("transformer.wte.weight", "lm_head.weight")),
    "gpt2_tied_head_differs": (lambda: _causal("gpt2"), None,
                               {"lm_head.weight": _differs("transformer.wte.weight", 7)},
                               ("transformer.wte.weight", "lm_head.weight")),
    "llama_untied": (lambda: _causal("llama"), None, {}, ("model.embed_tokens.weight", "lm_head.weight")),
    "llama_tied": (lambda: _causal("llama", tie_word_embeddings=True), None, {}, ()),
    "llama_tied_head_differs": (lambda: _causal("llama", tie_word_embeddings=True), None,
                                {"lm_head.weight": _differs("model.embed_tokens.weight", 8)},
                                ("model.embed_tokens.weight", "lm_head.weight")),
}
# The cases whose config ties a pair the checkpoint holds apart: the engine warns, as HF does.
UNTIED_AGAINST_CONFIG = {"bart_tied_head_differs", "mbart_tied_encoder_embedding_differs",
                         "m2m100_tied_decoder_embedding_differs", "marian_tied_head_differs", "t5_embeddings_differ",
                         "gpt2_tied_head_differs", "llama_tied_head_differs", "whisper_tied_head_differs"}
# (T5's own head is untied quietly: transformers 5 forces the tie on every T5 config, v1.1's too.)


def _save_text_case(name: str, dst: Path) -> Path:
    make, change, edits, differ = TEXT_CASES[name]
    model_cls, config = make()
    torch.manual_seed(sum(map(ord, name)))
    model = model_cls(config).eval()
    _randomize(model)
    if change is not None:
        change(model)
    model.save_pretrained(dst)
    if edits:
        _edit_weights(dst, edits)
    _all_differ(dst, *differ)
    return dst


def _prompts(seed: int, vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, vocab, (n,), generator=g).tolist()} for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("name", list(TEXT_CASES))
def test_text_model_ties_as_transformers_does(name, tmp_path, make_llm, caplog):
    folder = _save_text_case(name, tmp_path / name)
    with caplog.at_level(logging.WARNING, logger="encdec_engine"):
        llm = make_llm(folder, num_kv_blocks=64, skip_tokenizer_init=True)

    hf_cls = TEXT_CASES[name][0]()[0]
    hf = hf_cls.from_pretrained(folder).eval()
    outs = llm.generate(_prompts(len(name), VOCAB), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    if hf.config.is_encoder_decoder:
        ref = [hf_greedy(hf, o.encoder_prompt_token_ids, o.prompt_token_ids, MAX_TOKENS) for o in outs]
    else:
        ref = [hf_causal_greedy(hf, o.prompt_token_ids, MAX_TOKENS) for o in outs]
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert len({tuple(r) for r in ref}) > 1  # the random model is not stuck on one answer
    warned = [r for r in caplog.records if "holds them apart" in r.getMessage()]
    assert bool(warned) == (name in UNTIED_AGAINST_CONFIG)


def test_marian_separate_vocab_generates_only_decoder_tokens(tmp_path, make_llm):
    """The head has decoder_vocab_size rows: no token past the decoder's vocabulary comes out."""
    folder = _save_text_case("marian_separate_vocab", tmp_path / "marian")
    llm = make_llm(folder, num_kv_blocks=64, skip_tokenizer_init=True)
    d_model = llm.engine.hf_config.d_model
    assert llm.engine.model.compute_logits(torch.zeros(1, d_model)).shape == (1, VOCAB - 27)
    outs = llm.generate(_prompts(3, VOCAB), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert max(t for o in outs for t in o.outputs[0].token_ids) < VOCAB - 27
    # Encoder prompts draw from the whole vocabulary, decoder prompts and logit biases from the decoder's.
    encoder_only = {"encoder_prompt": {"prompt_token_ids": [VOCAB - 3, 5, 2]},
                    "decoder_prompt": {"prompt_token_ids": [0]}}
    assert llm.generate([encoder_only], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    past_decoder = {"encoder_prompt": {"prompt_token_ids": [5, 2]}, "decoder_prompt": {"prompt_token_ids": [0, VOCAB - 3]}}
    with pytest.raises(ValueError, match=rf"decoder_prompt: token id {VOCAB - 3} .* vocabulary \[0, {VOCAB - 27}\)"):
        llm.generate([past_decoder], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match=str(VOCAB - 3)):
        llm.generate([encoder_only], SamplingParams(temperature=0.0, max_tokens=2, logit_bias={VOCAB - 3: 5.0}),
                     use_tqdm=False)


def test_untied_config_with_a_missing_embedding_is_refused(tmp_path):
    """HF would start the missing embedding from random values; the engine names it instead."""
    from encdec_engine import LLM

    folder = _save_text_case("bart_untied", tmp_path / "bart")
    _edit_weights(folder, {"model.encoder.embed_tokens.weight": lambda w: None})
    with pytest.raises(ValueError, match=r"missing weights: encoder\.embed_tokens\.weight"):
        LLM(model=str(folder), num_kv_blocks=64, skip_tokenizer_init=True)


# -- Whisper: proj_out tied to the decoder's token embedding ----------------------------------------

WHISPER_CASES = {
    "whisper_untied": (dict(tie_word_embeddings=False), {}),
    "whisper_tied_head_differs": ({}, {"proj_out.weight": _differs("model.decoder.embed_tokens.weight", 9)}),
}


@pytest.mark.parametrize("name", list(WHISPER_CASES))
def test_whisper_proj_out_ties_as_transformers_does(name, tmp_path, make_llm, caplog):
    from transformers import GenerationConfig, WhisperForConditionalGeneration

    overrides, edits = WHISPER_CASES[name]
    folder = make_whisper(tmp_path / name, "tiny-80", **overrides)
    _edit_weights(folder, edits)
    _all_differ(folder, "model.decoder.embed_tokens.weight", "proj_out.weight")
    ties = json.loads((folder / "config.json").read_text()).get("tie_word_embeddings", True)
    assert ties == (name == "whisper_tied_head_differs")

    features = torch.randn(2, 80, 3000, generator=torch.Generator().manual_seed(0)) * 0.5
    with caplog.at_level(logging.WARNING, logger="encdec_engine"):
        llm = make_llm(folder, num_kv_blocks=240)
    outs = llm.generate([{"prompt": "", "multi_modal_data": {"input_features": f}} for f in features],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    hf = WhisperForConditionalGeneration.from_pretrained(folder).eval()
    gc = GenerationConfig.from_pretrained(folder)
    with torch.no_grad():
        ref = hf.generate(input_features=features, generation_config=gc, max_new_tokens=MAX_TOKENS,
                          return_dict_in_generate=True).sequences.tolist()
    ref = [row[: row.index(gc.pad_token_id) + 1] if gc.pad_token_id in row else row for row in ref]  # EOS pads
    assert [o.prompt_token_ids + o.outputs[0].token_ids for o in outs] == ref
    assert any("holds them apart" in r.getMessage() for r in caplog.records) == (name in UNTIED_AGAINST_CONFIG)
