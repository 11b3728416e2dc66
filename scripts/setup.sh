#!/usr/bin/env bash
# Sets up encdec-engine on a fresh machine, in a virtual environment in .venv:
#
#   bash scripts/setup.sh          what transcription, summarization and the server need (the runtime)
#   bash scripts/setup.sh test     the runtime and the test dependencies (Ray, Triton, xformers, fuzzing,
#                                  the peers the tests compare with), plus, as root, the Debian tools
#                                  the speech tests use (espeak-ng, ffmpeg, sox)
#
# torch is the CPU build: from the PyTorch CPU wheel index when it can be reached, else from a local
# wheel folder ($PIP_FIND_LINKS or /opt/wheels), else from the default index with a warning (on Linux
# that is a CUDA build of several GB). A CUDA machine installs its own torch first; this script then
# keeps it. Re-running is cheap: what is installed is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH=torch==2.13.0
MODE=${1:-runtime}
case "$MODE" in runtime|test) ;; *) echo "usage: bash scripts/setup.sh [test]" >&2; exit 2 ;; esac

need_tools=(ffmpeg)
[ "$MODE" = test ] && need_tools+=(espeak-ng sox)
missing=()
for tool in "${need_tools[@]}"; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "note: install ${missing[*]} (ffmpeg decodes m4a, webm and other containers; the speech tests use espeak-ng and sox)" >&2
  fi
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip -q --disable-pip-version-check)

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if curl -fsS -m 5 -o /dev/null https://download.pytorch.org/whl/cpu/torch/ 2>/dev/null; then
    "${PIP[@]}" install "$TORCH" --index-url https://download.pytorch.org/whl/cpu
  elif [ -n "${PIP_FIND_LINKS:-}" ] || [ -d /opt/wheels ]; then
    "${PIP[@]}" install --find-links "${PIP_FIND_LINKS:-/opt/wheels}" "$TORCH"
  else
    echo "warning: the PyTorch CPU index is unreachable and there is no local wheel folder; installing $TORCH" \
         "from the default index (a CUDA build on Linux)" >&2
    "${PIP[@]}" install "$TORCH"
  fi
fi
if [ "$MODE" = test ]; then
  "${PIP[@]}" install -e ".[test]"
else
  "${PIP[@]}" install -e .
fi
echo "encdec-engine is set up in $VENV ($MODE; $(du -sm "$VENV" | cut -f1) MB)"
