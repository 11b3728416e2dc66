"""int8 weights on the CPU (quantization="int8"): the kernels against a dequantized reference, the
per-machine kernel choice, CTranslate2 int8 exports imported without loss, and agreement with fp32."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jiwer
import pytest
import torch
import torch.nn.functional as F
from helpers import mixed_prompts, norm
from torch import nn

from encdec_engine import SamplingParams
from encdec_engine.config import EngineConfig
from encdec_engine.machine import cpu_kernels
from encdec_engine.machine.cpu_kernels import CpuLinearPlan, choose_fp32, choose_int8_decode, choose_int8_outliers
from encdec_engine.quantization.int8_weights import (ACTIVATION_ROWS, Int8Linear, Int8Weight, RowScaledInt8Weight,
                                                     fbgemm_available, fbgemm_full_range, int_mm_is_exact,
                                                     quantize_per_channel, quantize_rows)
from encdec_engine.layers.linear import PackedLinear, VocabProjection, bf16_native
from encdec_engine.checkpoints.ct2.format import read_ct2_variables
from encdec_engine.checkpoints.ct2.importer import default_model_path, import_ct2_whisper

pytestmark = pytest.mark.skipif(not fbgemm_available(), reason="torch built without fbgemm")

AUDIO = Path(__file__).resolve().parents[2] / "prompts" / "audio"
TRANSCRIPTS = json.loads((AUDIO / "transcripts.json").read_text())
SHORT_CLIPS = sorted(n for n in TRANSCRIPTS if not n.startswith("long"))
EXACT = dict(timestamps=False, temperatures=(0.0,))


def test_per_channel_quantization_rounds_each_row_to_its_own_step():
    torch.manual_seed(0)
    w = torch.randn(6, 40) * torch.tensor([1e-3, 0.1, 1.0, 10.0, 1.0, 0.0])[:, None]  # last row all zero
    q, scale = quantize_per_channel(w)
    assert q.dtype == torch.int8 and scale.shape == (6,)
    assert (q[:5].abs().amax(1) == 127).all() and (q[5] == 0).all()  # every row uses the full range
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all()


def test_per_channel_quantization_in_blocks_is_the_whole_matrix_formula():
    torch.manual_seed(1)
    w = torch.randn(2500, 24, dtype=torch.float16) * torch.rand(2500, 1, dtype=torch.float16)  # > 2 blocks of rows
    w[1023:1026] = 0  # all-zero rows across a block boundary
    q, scale = quantize_per_channel(w)
    full = w.float()
    amax = full.abs().amax(1)
    want_scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    assert torch.equal(scale, want_scale)
    assert torch.equal(q, torch.round(full / want_scale[:, None]).clamp(-127, 127).to(torch.int8))


def activation_bound(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fbgemm's error on top of the int8 weights: activations quantized once per call to 7-bit steps
    of (max - min) / 127 (0 in range), half a step each, times |w| summed over the inputs."""
    flat = x.reshape(-1, x.shape[-1])
    step = (flat.max().clamp(min=0) - flat.min().clamp(max=0)) / 127 if flat.numel() else torch.tensor(0.0)
    return (q.float() * scale[:, None]).abs().sum(1) * step / 2 + 1e-4  # [out]


@pytest.mark.parametrize("decode_kernel", ["fbgemm", "int8pack"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(0, 48), (1, 48), (5, 48), (2, 3, 48), (300, 48), (1100, 48)])
def test_int8_linear_matches_the_dequantized_weight(shape, bias, decode_kernel):
    torch.manual_seed(1)
    linear = nn.Linear(48, 80, bias=bias)
    q, scale = quantize_per_channel(linear.weight)
    x = torch.randn(shape)
    expected = F.linear(x, q.float() * scale[:, None], linear.bias)
    got = Int8Linear(linear, decode_kernel=decode_kernel, decode_rows=8)(x)
    assert got.shape == expected.shape and got.dtype == torch.float32
    rows = x.numel() // 48
    if decode_kernel == "int8pack" and 0 < rows <= 8:  # weight-only: fp32 activations, only rounding differs
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:
        assert ((got - expected).abs() <= activation_bound(x, q, scale)).all()


def test_a_loud_row_sets_the_activation_step_of_its_chunk_only():
    torch.manual_seed(3)
    weight = Int8Weight.quantize(torch.randn(32, 48))
    x = torch.randn(2 * ACTIVATION_ROWS, 48)
    loud = x.clone()
    loud[0] *= 1000
    quiet_out, loud_out = weight(x), weight(loud)
    assert torch.equal(loud_out[ACTIVATION_ROWS:], quiet_out[ACTIVATION_ROWS:])
    assert not torch.equal(loud_out[1:ACTIVATION_ROWS], quiet_out[1:ACTIVATION_ROWS])


def test_rows_are_quantized_each_to_its_own_step():
    x = torch.tensor([[0.5, -1.0, 0.25], [556.0, 0.1, -0.2], [0.0, 0.0, 0.0]])
    q, scale = quantize_rows(x)
    assert q.dtype == torch.int8 and scale.shape == (3, 1)
    assert q[0].tolist() == [64, -127, 32] and q[1, 0] == 127 and (q[2] == 0).all() and scale[2] == 1
    assert ((q.float() * scale - x).abs() <= scale / 2 + 1e-7).all()


needs_int_mm = pytest.mark.skipif(not int_mm_is_exact(), reason="torch._int_mm does not sum int8 exactly here")


@needs_int_mm
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 48), (2, 3, 48), (300, 48), (4500, 48)])  # 4,500 rows: three chunks
def test_row_scaled_int8_linear_is_each_rows_own_product(shape, bias):
    """Each row is rounded to 8 bits on its own step: the error bound is the row's, and a row's result is
    the same bits whatever rows are beside it (a loud one costs no other row its precision)."""
    torch.manual_seed(4)
    linear = nn.Linear(48, 80, bias=bias)
    q, scale = quantize_per_channel(linear.weight)
    x = torch.randn(shape) * torch.rand(*shape[:-1], 1) * 10
    layer = Int8Linear(linear, rows=True)
    got = layer(x)
    expected = F.linear(x, q.float() * scale[:, None], linear.bias)
    assert got.shape == expected.shape and got.dtype == torch.float32
    flat = x.reshape(-1, 48)
    step = flat.abs().amax(1, keepdim=True) / 127  # [rows, 1]
    bound = (step / 2) * (q.float() * scale[:, None]).abs().sum(1)[None, :] + 1e-4  # [rows, out]
    assert ((got.reshape(-1, 80) - expected.reshape(-1, 80)).abs() <= bound).all()
    loud = flat.clone()
    loud[0] *= 1000
    assert torch.equal(layer(loud)[1:], got.reshape(-1, 80)[1:])
    assert torch.equal(layer(flat[-1:]), got.reshape(-1, 80)[-1:])  # alone: the same bits
    assert "activations per row" in repr(layer)
    assert torch.equal(layer.weight_int8.int8_values()[0], q)


def test_int8_weight_keeps_the_values_it_was_given():
    q = torch.randint(-127, 128, (32, 16), dtype=torch.int8)
    scale = torch.rand(32) + 0.01
    got_q, got_scale = Int8Weight(q, scale, None).int8_values()
    assert torch.equal(got_q, q)
    torch.testing.assert_close(got_scale, scale, rtol=1e-7, atol=0)
    with pytest.raises(ValueError, match="int8"):
        Int8Weight(q.float(), scale, None)
    with pytest.raises(ValueError, match="decode kernel"):
        Int8Weight(q, scale, None, decode_kernel="int4")


def test_vocab_projection_on_int8_follows_weight_changes():
    torch.manual_seed(2)
    weight, hidden = torch.randn(100, 16), torch.randn(3, 16)
    project = VocabProjection()
    project.use(Int8Weight.quantize, lambda w: w.is_floating_point())
    for _ in range(2):
        q, scale = quantize_per_channel(weight)
        expected = hidden @ (q.float() * scale[:, None]).T
        assert ((project(hidden, weight) - expected).abs() <= activation_bound(hidden, q, scale)).all()
        weight.mul_(-2)  # in place: the int8 copy must follow


# -- the per-machine choice (pure functions: any capability, any timings) -----------------
def timings(**ms: float) -> dict[str, float]:
    return {k.replace("__", "/"): v / 1e3 for k, v in ms.items()}


def test_fp32_choice_starts_from_the_capability_and_needs_a_clear_win():
    even = timings(mkl__decode=1.0, onednn__decode=1.0, mkl__batch=10, onednn__batch=10, mkl__vocab=5, onednn__vocab=5)
    assert choose_fp32("AVX2", True, even) == "mkl"
    assert choose_fp32("AVX512", True, even) == "onednn"
    assert choose_fp32("AVX512", False, even) == "mkl"  # no oneDNN in this torch
    assert choose_fp32("AVX2", True, {}) == "mkl" and choose_fp32("AVX512", True, {}) == "onednn"
    onednn_2x = timings(mkl__decode=0.04, onednn__decode=0.03, mkl__batch=7.9, onednn__batch=3.4,
                        mkl__vocab=5.2, onednn__vocab=1.3)  # the AVX-512 EPYC the previous session measured
    assert choose_fp32("AVX2", True, onednn_2x) == "onednn"  # an AVX2 machine where oneDNN still wins
    slightly = timings(mkl__decode=1.0, onednn__decode=0.95, mkl__batch=10, onednn__batch=9.5, mkl__vocab=5,
                       onednn__vocab=4.8)
    assert choose_fp32("AVX2", True, slightly) == "mkl"  # under the margin: noise, keep the default
    mkl_wins = timings(mkl__decode=0.3, onednn__decode=0.43, mkl__batch=34, onednn__batch=44, mkl__vocab=10.6,
                       onednn__vocab=17.4)  # measured on an AVX2 EPYC
    assert choose_fp32("AVX512", True, mkl_wins) == "mkl"


def test_int8_decode_choice_takes_the_weight_only_kernel_only_where_it_is_vectorized():
    fast_pack = timings(fbgemm__decode=0.1, int8pack__decode=0.05, fbgemm__vocab=2.7, int8pack__vocab=1.0)
    assert choose_int8_decode("AVX2", fast_pack) == "fbgemm"  # no AVX-512 kernel: never, whatever the timings
    assert choose_int8_decode("AVX512", fast_pack) == "int8pack"
    slow_pack = timings(fbgemm__decode=0.1, int8pack__decode=1.0, fbgemm__vocab=2.7, int8pack__vocab=36)
    assert choose_int8_decode("AVX512", slow_pack) == "fbgemm"
    assert choose_int8_decode("AVX512", {}) == "fbgemm"


def test_outlier_linears_take_row_scales_only_where_int_mm_is_exact_and_not_clearly_slower():
    assert choose_int8_outliers(False, timings(rows__ffn_out=0.1, fp32__ffn_out=10)) == "fp32"  # would saturate
    assert choose_int8_outliers(True, timings(rows__ffn_out=1.2, fp32__ffn_out=2.4)) == "rows"  # Zen 5, measured
    assert choose_int8_outliers(True, timings(rows__ffn_out=1.2, fp32__ffn_out=1.2)) == "rows"
    assert choose_int8_outliers(True, timings(rows__ffn_out=3.0, fp32__ffn_out=2.0)) == "fp32"
    assert choose_int8_outliers(True, {}) == "rows"


def test_calibration_times_every_kernel_on_every_probe():
    calls = []

    def kernel(name):
        def prepare(weight, bias):
            return lambda x: calls.append((name, tuple(x.shape), tuple(weight.shape))) or x @ weight.T
        return prepare

    probes = (("decode", 1, 8, 16, 2), ("batch", 4, 8, 16, 1))
    got = cpu_kernels.calibrate({"a": kernel("a"), "b": kernel("b")}, probes)
    assert set(got) == {"a/decode", "b/decode", "a/batch", "b/batch"} and all(t >= 0 for t in got.values())
    assert ("a", (1, 8), (16, 8)) in calls and ("b", (4, 8), (16, 8)) in calls


def test_calibration_is_kept_per_machine(tmp_path, monkeypatch):
    """The first process times the kernels and keeps the timings; a later one with the same key (CPU, torch,
    threads, kernels, probes) takes them without timing; another key, ENCDEC_RECALIBRATE or a damaged file
    times them again."""
    monkeypatch.delenv("ENCDEC_RECALIBRATE", raising=False)
    path = tmp_path / "cache" / cpu_kernels.CALIBRATION_FILE
    probes = (("decode", 1, 8, 16, 2),)
    runs = []

    def kernel(name):
        return lambda weight, bias: lambda x: runs.append(name) or x @ weight.T

    kernels = {"a": kernel("a"), "b": kernel("b")}
    first, source = cpu_kernels.calibrate_once(kernels, probes, path)
    assert source is None and set(first) == {"a/decode", "b/decode"} and runs
    runs.clear()
    again, source = cpu_kernels.calibrate_once(kernels, probes, path)
    assert (again, source, runs) == (first, path, [])
    other, source = cpu_kernels.calibrate_once(kernels, (("decode", 2, 8, 16, 2),), path)  # another probe set
    assert source is None and runs
    assert len(json.loads(path.read_text())) == 2  # both kept
    runs.clear()
    monkeypatch.setenv("ENCDEC_RECALIBRATE", "1")
    assert cpu_kernels.calibrate_once(kernels, probes, path)[1] is None and runs
    monkeypatch.delenv("ENCDEC_RECALIBRATE")
    path.write_text("{not json")
    runs.clear()
    assert cpu_kernels.calibrate_once(kernels, probes, path)[1] is None and runs
    assert cpu_kernels.calibrate_once(kernels, probes, path)[1] == path  # rewritten whole
    edited = json.loads(path.read_text())
    path.write_text(json.dumps({key: {name: "fast" for name in value} for key, value in edited.items()}))
    assert cpu_kernels.calibrate_once(kernels, probes, path)[1] is None  # timings that are not numbers
    blocked = tmp_path / "file"
    blocked.write_text("")
    timings, source = cpu_kernels.calibrate_once(kernels, probes, blocked / "sub" / "k.json")  # cannot be written
    assert source is None and set(timings) == {"a/decode", "b/decode"}


def test_plan_describes_what_runs():
    assert "MKL" in CpuLinearPlan("AVX2", "mkl").describe()
    text = CpuLinearPlan("AVX512", "mkl", "int8pack", {"fbgemm/decode": 1e-4}).describe()
    assert "AVX512" in text and "_weight_int8pack_mm" in text and "fbgemm/decode 0.10 ms" in text
    kept = CpuLinearPlan("AVX2", "onednn", None, {"mkl/decode": 1e-4}, Path("/c/cpu_kernels.json")).describe()
    assert "oneDNN" in kept and "kept in /c/cpu_kernels.json" in kept
    assert "a scale per row" in CpuLinearPlan("AVX512", "mkl", "fbgemm", int8_outliers="rows").describe()
    assert "outliers in fp32" in CpuLinearPlan("AVX2", "mkl", "fbgemm", int8_outliers="fp32").describe()


def test_int8_config_is_validated():
    for bad, match in [(dict(quantization="int4"), "quantization"), (dict(kv_cache_dtype="fp8"), "kv_cache_dtype"),
                       (dict(quantization="int8", dtype="float16"), "float32")]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(model="m", **bad)


# -- end to end ------------------------------------------------------------------------
def test_ct2_int8_export_imports_without_a_second_rounding(tmp_path, make_llm):
    """CTranslate2's int8 values and per-row scales come back exactly in the engine's int8 linears."""
    converters = pytest.importorskip("ctranslate2.converters")
    ct2 = tmp_path / "ct2-int8"
    converters.TransformersConverter(str(default_model_path())).convert(str(ct2), quantization="int8")
    shutil.copy(default_model_path() / "tokenizer.json", ct2)
    _, variables = read_ct2_variables(ct2 / "model.bin")
    model = make_llm(import_ct2_whisper(ct2, tmp_path / "hf"), quantization="int8").engine.model
    pairs = {"decoder.layers.1.self_attn.qkv_proj": "decoder/layer_1/self_attention/linear_0",
             "decoder.layers.1.encoder_attn.kv_proj": "decoder/layer_1/attention/linear_1",
             "decoder.layers.3.encoder_attn.out_proj": "decoder/layer_3/attention/linear_2",
             "encoder.layers.0.fc1": "encoder/layer_0/ffn/linear_0",
             "decoder.layers.2.fc2": "decoder/layer_2/ffn/linear_1"}
    modules = dict(model.named_modules())
    for ours, theirs in pairs.items():
        q, scale = modules[ours].weight_int8.int8_values()
        assert torch.equal(q, variables[f"{theirs}/weight"]), ours
        expected = 1 / variables[f"{theirs}/weight_scale"]
        if ours.endswith("self_attn.qkv_proj"):  # the q rows carry the query scaling, 1/8 (fold_query_scaling)
            expected[:384] *= 0.125
        torch.testing.assert_close(scale, expected, rtol=1e-6, atol=0)
    # every linear but the encoder's fc2 (Whisper.linears_with_outlier_inputs: int8 with a scale per row, or
    # float): 3 per encoder layer, 7 per decoder layer; fc2 holds CTranslate2's int8 values (times their scales)
    rows = cpu_kernels.machine_plan(int8=True).int8_outliers == "rows"
    assert sum(isinstance(m, Int8Linear) for m in modules.values()) == 4 * (3 + rows) + 4 * 7
    fc2 = "encoder/layer_2/ffn/linear_1"
    q, ct2_scale = variables[f"{fc2}/weight"], variables[f"{fc2}/weight_scale"]
    kept = modules["encoder.layers.2.fc2"]
    if rows:
        assert torch.equal(kept.weight_int8.int8_values()[0], q)
    else:
        assert torch.equal(torch.round(float_weight(kept) * ct2_scale[:, None]).to(torch.int8), q)
    head = Int8Weight.quantize(model.decoder.embed_tokens.weight)  # the tied logits projection
    assert torch.equal(head.int8_values()[0], variables["decoder/projection/weight"])


@pytest.fixture(scope="module")
def fp32_results(make_llm):
    return make_llm(default_model_path()).transcribe([AUDIO / n for n in SHORT_CLIPS], **EXACT)


def corpus_wer(results) -> float:
    return jiwer.wer([norm(TRANSCRIPTS[n]) for n in SHORT_CLIPS], [norm(r.text) for r in results])


def assert_agrees_with_fp32(results, fp32_results) -> None:
    """int8's stated bound against fp32 on the 7 clips: at least 4 token for token, 90% of the tokens equal
    at their position, corpus WER at most 2 points above fp32's."""
    got, ref = [r.segments[0].tokens for r in results], [r.segments[0].tokens for r in fp32_results]
    assert sum(a == b for a, b in zip(got, ref)) >= 4
    assert sum(x == y for a, b in zip(got, ref) for x, y in zip(a, b)) >= 0.9 * sum(len(a) for a in ref)
    assert corpus_wer(results) <= corpus_wer(fp32_results) + 0.02


def test_int8_weights_agree_with_fp32_on_the_clips(make_llm, fp32_results):
    """Stated bound: at least 4 of the 7 clips token for token, 90% of the tokens equal at their
    position, corpus WER at most 2 points above fp32's (measured: 5/7, 80/83 tokens, one other clip
    differing in case, one in a word, WER 6.7% against fp32's 8.0%)."""
    llm = make_llm(default_model_path(), quantization="int8")
    model = llm.engine.model
    outliers = model.linears_with_outlier_inputs()
    rows = cpu_kernels.machine_plan(int8=True).int8_outliers == "rows"
    linears = [m for m in model.modules() if type(m) in (nn.Linear, PackedLinear, Int8Linear)]
    assert outliers and all(isinstance(m, Int8Linear) == (rows or not any(m is k for k in outliers)) for m in linears)
    assert all((m.weight_int8.decode_kernel == "rows") == any(m is k for k in outliers)
               for m in linears if isinstance(m, Int8Linear))
    assert_agrees_with_fp32(llm.transcribe([AUDIO / n for n in SHORT_CLIPS], **EXACT), fp32_results)


def test_int8_decoder_beside_a_bf16_encoder_agrees_with_fp32(make_llm, fp32_results):
    """compute_type="int8_bfloat16": Whisper's encoder and the decoder's cross K/V projections in bf16 (oneDNN's
    packed bf16 where the CPU has it), every other decoder linear and the vocab head on int8 weights with fp32
    activations, a bf16 KV pool read by the fp32 decode; held to int8's bounds against fp32 (measured: 7/7
    clips token for token, WER 8.0% as fp32's)."""
    llm = make_llm(default_model_path(), compute_type="int8_bfloat16")
    engine, model = llm.engine, llm.engine.model
    assert {p.dtype for p in model.encoder.parameters()} == {torch.bfloat16}
    encoder = [m for m in model.encoder.modules() if type(m) in (nn.Linear, PackedLinear, Int8Linear)]
    assert encoder and not any(isinstance(m, Int8Linear) for m in encoder)
    cross_kv = [layer.encoder_attn.kv_proj for layer in model.decoder.layers]
    assert {p.dtype for m in cross_kv for p in m.parameters()} == {torch.bfloat16}
    assert all(isinstance(m, PackedLinear) == bf16_native() for m in cross_kv)
    decoder = [m for m in model.decoder.modules() if type(m) in (nn.Linear, PackedLinear, Int8Linear)
               and not any(m is kv for kv in cross_kv)]
    assert decoder and all(isinstance(m, Int8Linear) for m in decoder)
    assert engine.kv_cache_dtype == torch.bfloat16 and "bfloat16 encoder, int8 decoder" in engine.describe()
    assert_agrees_with_fp32(llm.transcribe([AUDIO / n for n in SHORT_CLIPS], **EXACT), fp32_results)


def test_int8_bfloat16_needs_an_encoder_of_its_own(bart_path, make_llm):
    """BART's encoder shares its embedding with the decoder: it cannot run in another type."""
    with pytest.raises(ValueError, match="int8_bfloat16.*shares weights with its decoder: use compute type int8"):
        make_llm(bart_path, compute_type="int8_bfloat16")


@pytest.mark.parametrize("config", ["small", "odd_heads", "untied"])
def test_every_bart_shape_runs_on_int8(config, bart_paths, make_llm):
    """Tied and untied heads, odd head counts: every linear is int8, and a mixed batch runs to its
    token budget within the vocabulary."""
    llm = make_llm(bart_paths[config], num_kv_blocks=300, quantization="int8")
    model = llm.engine.model
    assert not [n for n, m in model.named_modules() if type(m) is nn.Linear]
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) > 0
    prompts = mixed_prompts(llm.get_tokenizer(), n=6, seed=9)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    vocab = llm.engine.input_processor.vocab_size
    assert all(len(o.outputs[0].token_ids) == 8 and max(o.outputs[0].token_ids) < vocab for o in outs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints_are_quantized_once_at_load(dtype, bart_path, tmp_path, make_llm):
    from transformers import BartForConditionalGeneration

    half = BartForConditionalGeneration.from_pretrained(bart_path).to(dtype)
    half.save_pretrained(tmp_path / "half")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json"):
        if (bart_path / name).is_file():
            (tmp_path / "half" / name).write_bytes((bart_path / name).read_bytes())
    llm = make_llm(tmp_path / "half", num_kv_blocks=100, quantization="int8")
    q, scale = llm.engine.model.encoder.layers[0].fc1.weight_int8.int8_values()
    want_q, want_scale = quantize_per_channel(half.model.encoder.layers[0].fc1.weight.float())
    assert torch.equal(q, want_q)
    torch.testing.assert_close(scale, want_scale, rtol=1e-6, atol=0)
    out = llm.generate(["The river"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_every_command_takes_the_int8_flags():
    """`serve`, `transcribe`, `generate` and `summarize` share the engine flags; faster-whisper's
    --compute-type spelling maps onto them, and a contradiction is refused."""
    from encdec_engine.cli.main import build_parser
    from encdec_engine.cli.args import engine_kwargs as _engine_kwargs

    parse = build_parser().parse_args
    for command in (["serve"], ["transcribe", "a.wav"], ["generate", "p.jsonl", "--model", "m"],
                    ["summarize", "f.txt", "--model", "m"]):
        kwargs = _engine_kwargs(parse(command + ["--compute-type", "int8", "--kv-cache-dtype", "int8"]))
        assert (kwargs["quantization"], kwargs["kv_cache_dtype"], kwargs["dtype"]) == ("int8", "int8", "float32")
    assert _engine_kwargs(parse(["serve", "--quantization", "int8"]))["quantization"] == "int8"
    assert _engine_kwargs(parse(["serve", "--compute-type", "float32"]))["quantization"] is None
    with pytest.raises(ValueError, match="contradicts"):
        _engine_kwargs(parse(["serve", "--quantization", "int8", "--compute-type", "float32"]))


def test_the_fp32_kernel_can_be_pinned_for_every_process(monkeypatch):
    """ENCDEC_CPU_LINEAR pins the fp32 kernel without calibrating (server replicas and Ray workers then sum
    in one order); a value it does not know is an error naming it."""
    from encdec_engine.machine import cpu_kernels

    for value, kernel in (("mkl", "mkl"), ("default", "onednn" if cpu_kernels.is_avx512(
            torch.backends.cpu.get_cpu_capability()) and cpu_kernels.onednn_packing_available() else "mkl")):
        monkeypatch.setenv("ENCDEC_CPU_LINEAR", value)
        cpu_kernels.machine_plan.cache_clear()
        plan = cpu_kernels.machine_plan(False)
        assert plan.fp32 == kernel and not plan.timings
    monkeypatch.setenv("ENCDEC_CPU_LINEAR", "fastest")
    cpu_kernels.machine_plan.cache_clear()
    with pytest.raises(ValueError, match="ENCDEC_CPU_LINEAR='fastest'"):
        cpu_kernels.machine_plan(False)
    cpu_kernels.machine_plan.cache_clear()


def test_the_outlier_kernel_can_be_pinned(monkeypatch):
    from encdec_engine.machine import cpu_kernels

    monkeypatch.setenv("ENCDEC_INT8_OUTLIERS", "fp32")
    cpu_kernels.machine_plan.cache_clear()
    assert cpu_kernels.machine_plan(True).int8_outliers == "fp32"
    if int_mm_is_exact():
        monkeypatch.setenv("ENCDEC_INT8_OUTLIERS", "rows")
        cpu_kernels.machine_plan.cache_clear()
        assert cpu_kernels.machine_plan(True).int8_outliers == "rows"
    monkeypatch.setenv("ENCDEC_INT8_OUTLIERS", "int4")
    cpu_kernels.machine_plan.cache_clear()
    with pytest.raises(ValueError, match="ENCDEC_INT8_OUTLIERS='int4'"):
        cpu_kernels.machine_plan(True)
    cpu_kernels.machine_plan.cache_clear()


def float_weight(module: nn.Module) -> torch.Tensor:
    """The [out, in] fp32 weight of an nn.Linear or a PackedLinear (unpacked through an identity matmul)."""
    if isinstance(module, PackedLinear):
        eye = torch.eye(module.in_features)
        bias = 0 if module.bias is None else module.bias
        return (module(eye) - bias).t().contiguous()
    return module.weight.detach()


def test_long_prefill_attention_follows_the_precision(make_llm):
    """Where the fp32 linears run on oneDNN, so does the encoder's long attention: fp32 for an fp32 engine
    (parity), bf16 matmuls for an int8 one where oneDNN has native bf16."""
    from encdec_engine.machine.cpu_kernels import machine_plan

    on = machine_plan(int8=False).fp32 == "onednn"
    fp32 = make_llm(default_model_path()).engine.runner.backend.onednn_attention
    int8 = make_llm(default_model_path(), quantization="int8").engine.runner.backend.onednn_attention
    assert fp32 == (torch.float32 if on else None)
    assert int8 == ((torch.bfloat16 if bf16_native() else torch.float32) if on else None)


def test_activations_keep_all_8_bits_where_fbgemm_sums_them_exactly():
    """`reduce_range` (7-bit activations) only where fbgemm's u8 x s8 pair sums saturate (no VNNI): with the
    full range available, 7 bits doubled the activations' rounding error for nothing (on a VNNI Xeon it
    turned "Stella" into "Taylor" on one of the seven clips)."""
    torch.manual_seed(0)
    weight = Int8Weight.quantize(torch.randn(64, 256))
    assert weight.reduce_range == (not fbgemm_full_range())
    q, scale = weight.int8_values()
    x = torch.randn(8, 256)
    want = x.double() @ (q.double() * scale.double()[:, None]).T
    errors = {}
    for reduce in (True, False):
        weight.reduce_range = reduce
        if reduce or fbgemm_full_range():
            errors[reduce] = (weight(x).double() - want).abs().mean().item()
    if fbgemm_full_range():
        assert errors[False] < 0.7 * errors[True]
