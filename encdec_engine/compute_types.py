"""faster-whisper's compute types (`compute_type="int8"`, `--compute-type auto`, ...) as the engine's
quantization and dtype. Kept free of torch: the command line checks them before anything heavy loads."""

from __future__ import annotations

# faster-whisper's compute types the engine runs, as (quantization, dtype). "auto": the fastest floating
# type this machine runs (dtype "fastest": bf16 where the CPU multiplies it natively and the per-machine
# calibration finds it faster, else fp32; machine/cpu_kernels.fastest_dtype). int8 is asked for by name.
# "int8_bfloat16": int8 where int8 is fastest (the decoder's linears, read once a token) and bf16 where
# bf16 is (the encoder's 1,500-row products): EngineConfig.bf16_encoder_int8_decoder.
COMPUTE_TYPES = {"int8": ("int8", "float32"), "int8_float32": ("int8", "float32"),
                 "int8_bfloat16": ("int8", "bfloat16"), "float32": (None, "float32"),
                 "bfloat16": (None, "bfloat16"), "auto": (None, "fastest"), "default": (None, "auto")}


# How the errors name the three options: the Python API's keywords, or the command line's flags.
KEYWORDS = ("compute_type", "quantization", "dtype")
FLAGS = ("--compute-type", "--quantization", "--dtype")


def fold_compute_type(compute_type: str, quantization: str | None, dtype: str,
                      names: tuple[str, str, str] = KEYWORDS) -> tuple[str | None, str]:
    """(quantization, dtype) with faster-whisper's `compute_type` folded in; a contradiction is refused,
    the options named as `names` spells them."""
    as_compute_type, as_quantization, as_dtype = names
    if compute_type not in COMPUTE_TYPES:
        raise ValueError(f"{as_compute_type} {compute_type}: the engine runs {', '.join(COMPUTE_TYPES)} "
                         f"(float16 is {as_dtype} float16, on CUDA)")
    quantization_ct, dtype_ct = COMPUTE_TYPES[compute_type]
    if quantization and quantization != quantization_ct:
        raise ValueError(f"{as_compute_type} {compute_type} contradicts {as_quantization} {quantization}")
    if dtype != "auto" and dtype_ct != "auto" and dtype != dtype_ct:
        raise ValueError(f"{as_compute_type} {compute_type} contradicts {as_dtype} {dtype}")
    return quantization or quantization_ct, dtype if dtype_ct == "auto" else dtype_ct
