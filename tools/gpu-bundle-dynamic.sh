#!/usr/bin/env bash
# Prepare .gpu-dynamic/ in the project root: ../shared/tools/gpu-bundle's .gpu/ for a ComfyUI that has
# dynamic VRAM (comfy-aimdo), so that a lent GPU runs sdopt the way ComfyUI 0.38 users run it
# (`--memory-mode auto`, the default, starts it there as ComfyUI's server does).
#
#   COMFYUI_PATH=/work/c033/ComfyUI tools/gpu-bundle-dynamic.sh   # the 0.33.0 tree (fetch github:yzkee/ComfyUI)
#
# Then call `run` with carry [".gpu-dynamic"] and a command that starts with `source .gpu-dynamic/setup.sh;`.
# The device takes 64 MiB with the checkout; to fit, this bundle carries only what ComfyUI's boot and
# sdopt's GPU tier import (no xFormers, SageAttention or diffusers: carry .gpu/ for those), and
# comfy-kitchen without its CUDA and HIP kernels (58 MiB), so ComfyUI quantizes fp8/fp4 with the
# kitchen's eager and Triton code there.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
src=${COMFYUI_PATH:?set COMFYUI_PATH to a ComfyUI with dynamic VRAM}
if ! grep -q "def enables_dynamic_vram" "$src/comfy/cli_args.py"; then
  echo "$src has no dynamic VRAM (comfy/cli_args.py defines no enables_dynamic_vram): use a newer ComfyUI" >&2
  exit 2
fi
pinned() { grep -i "^$1[=<>~]" "$src/requirements.txt" | head -1 | tr -d ' ' || true; }
packages="av torchsde trampoline sqlalchemy greenlet blake3 simpleeval $(pinned comfy-aimdo) $(pinned comfy-kitchen)"
grep -qx '/.gpu-dynamic/' .git/info/exclude 2>/dev/null || echo '/.gpu-dynamic/' >> .git/info/exclude
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git clone -q "$root" "$work/repo"
(cd "$work/repo" && COMFYUI_PATH="$src" GPU_BUNDLE_PACKAGES="$packages" "$root/../shared/tools/gpu-bundle" >/dev/null)
rm -rf .gpu-dynamic
mv "$work/repo/.gpu" .gpu-dynamic
python3 - .gpu-dynamic/whl/comfy_kitchen-*.whl <<'EOF'
import sys, zipfile
wheel = sys.argv[1]
kernels = lambda name: name.startswith("comfy_kitchen/backends/") and name.endswith("/_C.abi3.so")
with zipfile.ZipFile(wheel) as source:
    entries = [(info, source.read(info)) for info in source.infolist() if not kernels(info.filename)]
with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as trimmed:
    for info, data in entries:
        if info.filename.endswith(".dist-info/RECORD"):
            data = b"".join(line for line in data.splitlines(keepends=True) if not kernels(line.split(b",")[0].decode()))
        trimmed.writestr(info, data)
EOF
sed -i -e 's#\.gpu/#.gpu-dynamic/#g' -e 's#/tmp/site#/tmp/site-dynamic#g' -e 's#/tmp/ComfyUI#/tmp/ComfyUI-dynamic#g' .gpu-dynamic/setup.sh
du -sh .gpu-dynamic
echo "ready: carry .gpu-dynamic and start each GPU-side command with: source .gpu-dynamic/setup.sh;"
