"""Whisper's encoder over the first positions of a window (`mm_processor_kwargs={"audio_ctx": n}`, whisper.cpp's
audio_ctx): the decode equals HF's Whisper run over the same positions, token for token, alone and batched with
windows of other lengths; the input errors name the field."""

import pytest
import torch
import torch.nn.functional as F
from helpers import AUDIO

from encdec_engine import SamplingParams
from encdec_engine.checkpoints.ct2.importer import default_model_path
from encdec_engine.inputs.audio import load_audio
from encdec_engine.inputs.features import log_mel_spectrogram

SOT, NO_TIMESTAMPS, EOT = 50257, 50362, 50256  # tiny.en
GREEDY = SamplingParams(temperature=0, max_tokens=40)
CLIPS = ("coffee.wav", "fox.wav", "weather.wav")


def prompt(samples, audio_ctx: int | None) -> dict:
    encoder = {"prompt": "", "multi_modal_data": {"audio": (samples, 16000)}}
    if audio_ctx is not None:
        encoder["mm_processor_kwargs"] = {"audio_ctx": audio_ctx}
    return {"encoder_prompt": encoder, "decoder_prompt": {"prompt_token_ids": [SOT, NO_TIMESTAMPS]}}


def until_eot(tokens) -> list[int]:
    tokens = list(tokens)
    return tokens[: tokens.index(EOT)] if EOT in tokens else tokens


@torch.no_grad()
def hf_greedy(model, samples, audio_ctx: int, max_tokens: int = 40) -> list[int]:
    """HF's Whisper modules over the window's first `audio_ctx` positions (its encoder's forward refuses
    anything but 3000 frames, so its steps are run here one by one), then its decoder, greedy."""
    encoder = model.model.encoder
    features = log_mel_spectrogram([samples])[:, :, : 2 * audio_ctx]
    x = F.gelu(encoder.conv2(F.gelu(encoder.conv1(features)))).permute(0, 2, 1)
    hidden = x + encoder.embed_positions.weight[:audio_ctx]
    for layer in encoder.layers:
        hidden = layer(hidden, None)
    hidden = encoder.layer_norm(hidden)
    ids = torch.tensor([[SOT, NO_TIMESTAMPS]])
    for _ in range(max_tokens):
        token = model(encoder_outputs=(hidden,), decoder_input_ids=ids).logits[0, -1].argmax().item()
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        if token == EOT:
            break
    return until_eot(ids[0, 2:].tolist())


def test_a_window_cut_to_its_audio_ctx_decodes_as_hf_over_the_same_positions(tiny_en, hf_tiny_en):
    for clip in CLIPS:
        samples = load_audio(AUDIO / clip)
        audio_ctx = (len(samples) // 320 // 50 + 3) * 50  # the audio and 2-3 s of padding, whole seconds
        out = tiny_en.generate([prompt(samples, audio_ctx)], GREEDY, use_tqdm=False)[0]
        assert until_eot(out.outputs[0].token_ids) == hf_greedy(hf_tiny_en, samples, audio_ctx), clip


@pytest.mark.parametrize("seconds, audio_ctx", [(3.5, 100), (3.5, 175), (3.5, 176), (3.5, 300), (29.9, 1499), (0.5, 1)])
def test_the_features_of_a_cut_window_are_the_whole_windows_first_frames(tiny_en, seconds, audio_ctx):
    """Only the frames the encoder reads are computed, from all the audio (its peak clamps the range)."""
    samples = torch.randn(int(seconds * 16000), generator=torch.Generator().manual_seed(0)).numpy() * 0.1
    full = log_mel_spectrogram([samples])[0]
    seq = tiny_en.engine.input_processor.process(prompt(samples, audio_ctx), GREEDY).encoder_seq
    assert seq.num_positions == audio_ctx
    assert torch.equal(seq.features, full[:, : 2 * audio_ctx])


def test_windows_of_different_lengths_batch_as_each_decodes_alone(tiny_en, make_llm, monkeypatch):
    samples = [load_audio(AUDIO / c) for c in CLIPS]
    prompts = [prompt(samples[0], 200), prompt(samples[1], 350), prompt(samples[2], None), prompt(samples[0], 350)]
    alone = [until_eot(tiny_en.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) for p in prompts]
    uncached = make_llm(default_model_path(), enable_prefix_caching=False)  # every request runs the encoder
    model = uncached.engine.model
    encoded, encode = [], model.encode

    def recording_encode(inputs, metadata):
        encoded.append(inputs.features)
        return encode(inputs, metadata)

    monkeypatch.setattr(model, "encode", recording_encode)
    together = uncached.generate(prompts, GREEDY, use_tqdm=False)
    assert [until_eot(o.outputs[0].token_ids) for o in together] == alone
    # one encoder pass over the four windows, each at its own length (1500 positions for the whole window)
    assert [[f.shape[-1] for f in features] for features in encoded] == [[400, 700, 3000, 700]]
    # the same audio at two lengths is two encoder inputs: neither is served from the other's cached output
    process = tiny_en.engine.input_processor.process
    keys = {process(p, GREEDY).encoder_seq.cache_key for p in (prompts[0], prompts[3], prompt(samples[0], None))}
    assert len(keys) == 3


@pytest.mark.parametrize("kwargs, match", [
    ({"audio_ctx": 0}, r"audio_ctx must be an int of encoder positions in \[1, 1500\]"),
    ({"audio_ctx": 1501}, r"audio_ctx must be an int"),
    ({"audio_ctx": 12.5}, r"audio_ctx must be an int"),
    ({"audio_ctx": True}, r"audio_ctx must be an int"),
    ({"audio_context": 100}, r"unknown keys \['audio_context'\]"),
])
def test_bad_audio_ctx_is_refused_naming_the_field(tiny_en, kwargs, match):
    samples = load_audio(AUDIO / "coffee.wav")
    encoder = {"prompt": "", "multi_modal_data": {"audio": (samples, 16000)}, "mm_processor_kwargs": kwargs}
    with pytest.raises(ValueError, match=match):
        tiny_en.engine.input_processor.process({"encoder_prompt": encoder, "decoder_prompt": None}, GREEDY)


def test_mm_processor_kwargs_belong_to_an_audio_encoder_prompt(tiny_en, bart_llm):
    with pytest.raises(ValueError, match=r"takes text only, got mm_processor_kwargs \['audio_ctx'\]"):
        bart_llm.engine.input_processor.process({"prompt": "Hello", "mm_processor_kwargs": {"audio_ctx": 10}}, GREEDY)
    samples = load_audio(AUDIO / "coffee.wav")
    with pytest.raises(ValueError, match="mm_processor_kwargs must be a dict"):
        tiny_en.engine.input_processor.process(
            {"prompt": "", "multi_modal_data": {"audio": (samples, 16000)}, "mm_processor_kwargs": [1]}, GREEDY)
    with pytest.raises(ValueError, match="belong to the encoder prompt"):
        tiny_en.engine.input_processor.process(
            {"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": (samples, 16000)}},
             "decoder_prompt": {"prompt_token_ids": [SOT], "mm_processor_kwargs": {"audio_ctx": 100}}}, GREEDY)
