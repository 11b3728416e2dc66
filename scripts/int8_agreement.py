"""How close int8 Whisper stays to fp32, per choice the int8 engine makes, on real weights (tiny.en).

The int8 engine makes two choices beyond its int8 weights, each a trade of precision for speed:

    outliers    the encoder's fc2 (inputs with outliers): int8 with a scale per activation row
                ("rows", `RowScaledInt8Weight`) or fp32 (`ENCDEC_INT8_OUTLIERS`)
    attention   the encoder's long attention through oneDNN in bf16 or fp32 operands

Each combination the machine can run transcribes (a) --num-clips short clips (the bundled WAVs and
sentences synthesized with espeak-ng, as scripts/bench_whisper.py makes them) greedy, one window each,
and (b) long-form recordings one by one with the default decoding (timestamps, temperature fallback):
every bundled recording and --long-minutes of synthesized speech. Printed per row: files whose tokens
equal the fp32 engine's, and WER against the spoken text, beside the fp32 engine's own. No timing.

    python scripts/int8_agreement.py [--num-clips 44] [--long-minutes 4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_whisper import AUDIO_DIR, Audio, build_clips, build_long, cpu_line, wer  # noqa: E402


def transcribe(llm, audio: list[Audio], long_form: bool) -> tuple[list[str], list[list[int]]]:
    options = {} if long_form else {"timestamps": False, "temperatures": (0.0,)}
    results = llm.transcribe([a.path for a in audio], **options)
    return [r.text for r in results], [[t for s in r.segments for t in s.tokens] for r in results]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-clips", type=int, default=44)
    ap.add_argument("--long-minutes", type=float, default=4.0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    from encdec_engine import LLM
    from encdec_engine.layers.linear import bf16_native
    from encdec_engine.checkpoints.ct2.importer import default_model_path
    from encdec_engine.quantization.int8_weights import int_mm_is_exact
    from encdec_engine.machine import cpu_kernels

    torch.set_num_threads(args.threads)
    print(cpu_line())
    model = str(default_model_path())
    tmp = Path(tempfile.mkdtemp(prefix="int8-agreement-"))
    refs = json.loads((AUDIO_DIR / "transcripts.json").read_text())
    recordings = [Audio(AUDIO_DIR / name, text, 0.0) for name, text in sorted(refs.items())]
    workloads = {"clips": (build_clips(args.num_clips, tmp), False),
                 "long-form": (recordings + build_long(args.long_minutes, tmp)[1:], True)}
    for name, (audio, _) in workloads.items():
        print(f"{name}: {len(audio)} files")

    fp32 = LLM(model=model)
    reference = {name: transcribe(fp32, audio, long_form) for name, (audio, long_form) in workloads.items()}
    del fp32
    print(f"{'engine':<44}" + "".join(f"{name + ' same':>18}{name + ' WER %':>18}" for name in workloads))
    row = "".join(f"{len(audio):>18}{wer([a.text for a in audio], reference[name][0]):18.2f}"
                  for name, (audio, _) in workloads.items())
    print(f"{'fp32':<44}{row}")

    outlier_kernels = ["rows", "fp32"] if int_mm_is_exact() else ["fp32"]
    attention = [torch.bfloat16, torch.float32] if bf16_native() else [torch.float32]
    for kernel in outlier_kernels:
        os.environ["ENCDEC_INT8_OUTLIERS"] = kernel
        cpu_kernels.machine_plan.cache_clear()
        llm = LLM(model=model, quantization="int8")
        backend = llm.engine.runner.backend
        for dtype in attention if backend.onednn_attention is not None else [None]:
            if dtype is not None:
                backend.onednn_attention = dtype
            cells = []
            for name, (audio, long_form) in workloads.items():
                texts, tokens = transcribe(llm, audio, long_form)
                same = sum(a == b for a, b in zip(tokens, reference[name][1]))
                cells.append(f"{same:>18}{wer([a.text for a in audio], texts):18.2f}")
            label = f"int8, fc2 {kernel}, attention {str(dtype).removeprefix('torch.') if dtype else 'flash'}"
            print(f"{label:<44}" + "".join(cells))
        del llm
    print("same: files whose tokens equal the fp32 engine's; WER against the spoken text")
    return 0


if __name__ == "__main__":
    sys.exit(main())
