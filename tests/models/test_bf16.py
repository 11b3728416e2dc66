"""bf16 on the CPU (`dtype="bfloat16"`): weights and activations in bf16, the linears on oneDNN's packed bf16
where the CPU multiplies bf16 natively, a bf16 KV pool read in fp32 (the decode kernel widens each value as it
reads it; the copies and gathers widen what they copy).
Checked against HF `generate` in bf16: token for token on tiny.en's real weights, and on random weights
(flat logits, where rounding decides near-ties) every engine token is HF's argmax or within a few rounding steps
of it when HF is fed the engine's own tokens."""

import pytest
import torch
from helpers import AUDIO, SHORT_CLIPS, hf_greedy, make_whisper, mixed_prompts
from transformers import AutoModelForSeq2SeqLM, WhisperForConditionalGeneration

from encdec_engine import SamplingParams
from encdec_engine.attention.ops import cpu_decode
from encdec_engine.checkpoints.ct2.importer import default_model_path
from encdec_engine.engine import loader
from encdec_engine.inputs.audio import load_audio
from encdec_engine.inputs.features import log_mel_spectrogram
from encdec_engine.layers.linear import PackedLinear, bf16_native

NEAR_TIE = 4  # steps of bf16 at the row's largest logit: how far below HF's argmax an engine token may be


def near_argmax(logits: torch.Tensor, tokens: list[int]) -> list[tuple[int, float, float]]:
    """(step, gap, allowed) where the engine's token is below HF's argmax by more than NEAR_TIE steps of bf16
    at that row's magnitude (HF's logits are themselves rounded to bf16: 0.125 apart at 16-32); logits:
    [steps, vocab] in bf16."""
    logits = logits.float()
    gaps = logits.max(-1).values - logits[torch.arange(len(tokens)), torch.tensor(tokens)]
    steps = torch.exp2(torch.floor(torch.log2(logits.abs().amax(-1))) - 7)  # bf16: 8 significant bits
    return [(i, g.item(), NEAR_TIE * s.item()) for i, (g, s) in enumerate(zip(gaps, steps)) if g > NEAR_TIE * s]


@pytest.fixture(scope="module")
def tiny_en_bf16(make_llm):
    return make_llm(default_model_path(), dtype="bfloat16")


@pytest.fixture(scope="module")
def hf_bf16_tokens() -> list[list[int]]:
    """HF `generate` in bf16 on the short clips: the reference of both reads below, made once (on a CPU
    without native bf16 each run is emulated and slow)."""
    features = log_mel_spectrogram([load_audio(AUDIO / n) for n in SHORT_CLIPS])
    model = WhisperForConditionalGeneration.from_pretrained(default_model_path(), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        return [model.generate(input_features=f[None].bfloat16(), return_dict_in_generate=True).sequences[0].tolist()
                for f in features]


@pytest.mark.parametrize("reads", ["kernel", "copies"])
def test_tiny_en_transcripts_equal_hf_bfloat16(tiny_en_bf16, hf_bf16_tokens, reads, monkeypatch):
    backend = tiny_en_bf16.engine.runner.backend
    if reads == "copies":  # the bf16 pool read through the fp32 copies, as where the kernel cannot be built
        monkeypatch.setattr(backend, "fused_decode", None)
    elif backend.fused_decode is None:
        pytest.skip("the compiled decode kernel is not available here")
    results = tiny_en_bf16.transcribe([AUDIO / n for n in SHORT_CLIPS], timestamps=False, temperatures=(0.0,))
    prompt = tiny_en_bf16.engine.input_processor.default_decoder_prompt
    for name, result, ref in zip(SHORT_CLIPS, results, hf_bf16_tokens):
        assert result.error is None
        assert prompt + result.segments[0].tokens + [50256] == ref, name


def test_bf16_weights_bf16_pool_and_this_machines_kernels(tiny_en_bf16):
    engine = tiny_en_bf16.engine
    model = engine.runner.model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert engine.kv_cache_dtype == torch.bfloat16  # half an fp32 pool's bytes per token
    assert engine.runner.backend.fused_decode is cpu_decode.load()  # it reads bf16 pools too
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert bool(packed) == bf16_native()  # emulated bf16 stays on F.linear
    if bf16_native():
        assert engine.runner.backend.onednn_attention == torch.bfloat16
    assert engine.runner.backend.amx_flash == (bf16_native() and torch.cpu._is_amx_tile_supported())


def test_random_whisper_tokens_are_hf_bfloat16_argmax(tmp_path, make_llm):
    path = make_whisper(tmp_path / "whisper", "tiny-80")
    llm = make_llm(path, dtype="bfloat16")
    clips = [load_audio(AUDIO / n) for n in SHORT_CLIPS[:4]]
    prompt = [50257, 50362]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = llm.generate([{"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": (c, 16000)}},
                          "decoder_prompt": {"prompt_token_ids": prompt}} for c in clips], params, use_tqdm=False)
    model = WhisperForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16).eval()
    features = log_mel_spectrogram(clips)
    for clip, out, f in zip(SHORT_CLIPS, outs, features):
        tokens = list(out.outputs[0].token_ids)
        with torch.no_grad():
            logits = model(input_features=f[None].bfloat16(),
                           decoder_input_ids=torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
        assert not near_argmax(logits, tokens), clip


def fp32_gaps(model, encoder: list[int], decoder: list[int], tokens: list[int]) -> list[float]:
    """How far below fp32's argmax each token is, HF fp32 fed these tokens (0: fp32's own choice)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([encoder]),
                       decoder_input_ids=torch.tensor([decoder + tokens[:-1]])).logits[0, len(decoder) - 1:]
    return (logits.max(-1).values - logits[torch.arange(len(tokens)), torch.tensor(tokens)]).tolist()


@pytest.mark.parametrize("arch", ["t5", "mbart"])
def test_text_family_bf16_against_hf_bfloat16(arch, text_model, make_llm):
    """T5: every token HF bf16's argmax (within NEAR_TIE). mBART's random weights are chaotic in bf16 (HF's
    own bf16 path keeps fp32's argmax on half the steps), so there the engine's bf16 tokens must lose no
    more against fp32 than HF's bf16 greedy tokens do."""
    path = text_model(arch, "small")
    llm = make_llm(path, num_kv_blocks=400, dtype="bfloat16")
    prompts = mixed_prompts(llm.get_tokenizer(), n=8, seed=5)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, truncate_prompt_tokens=190),
                        use_tqdm=False)
    bf16 = AutoModelForSeq2SeqLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    fp32 = AutoModelForSeq2SeqLM.from_pretrained(path).eval()
    engine_gaps, hf_gaps = [], []
    for i, out in enumerate(outs):
        encoder, decoder = out.encoder_prompt_token_ids, list(out.prompt_token_ids)
        tokens = list(out.outputs[0].token_ids)
        if arch == "t5":
            with torch.no_grad():
                logits = bf16(input_ids=torch.tensor([encoder]),
                              decoder_input_ids=torch.tensor([decoder + tokens[:-1]])).logits[0, len(decoder) - 1:]
            assert not near_argmax(logits, tokens), i
        engine_gaps += fp32_gaps(fp32, encoder, decoder, tokens)
        hf_gaps += fp32_gaps(fp32, encoder, decoder, hf_greedy(bf16, encoder, decoder, len(tokens)))
    assert sum(g == 0 for g in engine_gaps) >= sum(g == 0 for g in hf_gaps) - 4
    assert sum(engine_gaps) <= 1.25 * sum(hf_gaps) + 1.0


def probe_timings(fp32: float, bf16: float) -> dict[str, float]:
    return {f"{kernel}/{probe}": seconds for kernel, seconds in (("fp32", fp32), ("bf16", bf16))
            for probe in ("decode", "batch", "vocab")}


def test_fastest_type_is_bf16_only_where_native_and_faster():
    from encdec_engine.machine.cpu_kernels import choose_dtype

    assert choose_dtype(False, probe_timings(fp32=1.0, bf16=0.1)) == "float32"  # AVX2: emulated, never
    assert choose_dtype(True, probe_timings(fp32=1.0, bf16=0.4)) == "bfloat16"  # AMX: measured 2-7x
    assert choose_dtype(True, probe_timings(fp32=1.0, bf16=0.95)) == "float32"  # within the margin
    assert choose_dtype(True, {}) == "float32"  # nothing timed


def test_fastest_dtype_calibrates_only_where_bf16_is_native(monkeypatch):
    from encdec_engine.machine import cpu_kernels

    calibrated = []
    monkeypatch.setattr(cpu_kernels, "calibrate_once", lambda kernels, *a, **k: calibrated.append(set(kernels))
                        or (probe_timings(fp32=1.0, bf16=0.3), None))
    for native, want in ((False, "float32"), (True, "bfloat16")):
        cpu_kernels.fastest_dtype.cache_clear()
        monkeypatch.setattr(cpu_kernels, "bf16_native", lambda: native)
        assert cpu_kernels.fastest_dtype() == want
    assert calibrated == [{"fp32", "bf16"}]
    cpu_kernels.fastest_dtype.cache_clear()


def test_compute_types_fold_into_quantization_and_dtype():
    from encdec_engine.config import EngineConfig

    folded = {ct: (c.quantization, c.dtype) for ct in ("int8", "int8_bfloat16", "float32", "bfloat16", "auto",
                                                       "default") for c in [EngineConfig(model="m", compute_type=ct)]}
    assert folded == {"int8": ("int8", "float32"), "int8_bfloat16": ("int8", "bfloat16"),
                      "float32": (None, "float32"), "bfloat16": (None, "bfloat16"), "auto": (None, "fastest"),
                      "default": (None, "auto")}
    assert EngineConfig(model="m", compute_type="int8_bfloat16").bf16_encoder_int8_decoder
    for bad, message in ((dict(compute_type="int16"), "compute_type int16: the engine runs"),
                         (dict(compute_type="bfloat16", quantization="int8"), "contradicts quantization int8"),
                         (dict(compute_type="auto", dtype="float32"), "contradicts dtype float32"),
                         (dict(dtype="fastest", quantization="int8"), "quantization='int8' computes in float32"),
                         (dict(dtype="float16", quantization="int8"), "dtype='float16' is not supported")):
        with pytest.raises(ValueError, match=message):
            EngineConfig(model="m", **bad)


def test_compute_type_auto_runs_this_machines_fastest_type(make_llm):
    from encdec_engine.machine.cpu_kernels import fastest_dtype

    llm = make_llm(default_model_path(), compute_type="auto")
    assert llm.engine.dtype == getattr(torch, fastest_dtype())
    assert llm.engine.config.dtype == fastest_dtype()
    assert llm.transcribe([AUDIO / "fox.wav"], timestamps=False)[0].text.strip()


@pytest.mark.parametrize("quantization, dtype, native, said", [
    (None, "bfloat16", False, "dtype bfloat16"), ("int8", "bfloat16", False, "compute type int8_bfloat16"),
    (None, "bfloat16", True, None), (None, "float32", False, None)])
def test_emulated_bf16_is_said_at_load(tmp_path, make_llm, monkeypatch, caplog, quantization, dtype, native, said):
    monkeypatch.setattr(loader, "bf16_native", lambda: native)
    with caplog.at_level("WARNING", logger=loader.__name__):
        make_llm(make_whisper(tmp_path / "whisper", "tiny-80"), quantization=quantization, dtype=dtype)
    warned = [r.getMessage() for r in caplog.records if "without native bf16" in r.getMessage()]
    assert warned == ([] if said is None else [f"{said} on a CPU without native bf16 (no AVX-512 BF16 or AMX): bf16 "
                                               "is emulated here, several times slower than float32; compute type "
                                               "'auto' picks this machine's fastest floating type, 'int8' its "
                                               "fastest type"])
