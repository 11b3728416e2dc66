#!/usr/bin/env bash
# Sets up encdec-engine on a fresh machine: a virtual environment in .venv with the
# CPU build of torch, the package (editable) and its test dependencies, plus the
# Debian tools the speech tests use (espeak-ng, ffmpeg, sox) when run as root.
# Re-running it is cheap: everything already installed is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

if ! command -v espeak-ng >/dev/null || ! command -v ffmpeg >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq espeak-ng ffmpeg sox >/dev/null
  else
    echo "note: install espeak-ng, ffmpeg and sox to run the speech tests" >&2
  fi
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip -q --disable-pip-version-check)
FIND_LINKS=()
[ -d /opt/wheels ] && FIND_LINKS=(--find-links /opt/wheels)
# The CPU build of torch, pinned: an unpinned torch pulls several GB of CUDA packages.
"$VENV/bin/python" -c "import torch" 2>/dev/null || "${PIP[@]}" install "${FIND_LINKS[@]}" torch==2.13.0
"${PIP[@]}" install "${FIND_LINKS[@]}" -e ".[test]"
echo "encdec-engine is set up in $VENV"
