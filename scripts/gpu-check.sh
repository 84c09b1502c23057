#!/usr/bin/env bash
# GPU check on a machine with an NVIDIA GPU: the WGSL backend (Vulkan) and the NCCL target.
# Runs the kernel tests on the real adapter, the NCCL tests (every collective forward + backward on
# NCCL vs the in-process group; mismatch detection with 2+ GPUs; staging and the shared Vulkan/CUDA
# data path), `distgrad train --backend nccl` on every GPU (up to 8; host tensors, then wgpu
# tensors over the shared path), the NCCL all_reduce benchmark (1 KiB .. 1 GiB, CUDA buffers vs
# host-staged vs shared, beside the device copy bandwidth) and the kernel benchmark, printing
# figures. Sized to finish in a few minutes.
#
#   scripts/gpu-check.sh            # from the repository root
#
# On the lent device machine (no Rust there): scripts/gpu-bundle.sh here first, then one run with
# carry [".gpu-bundle"] and the command
#   set -o pipefail; scripts/gpu-check.sh 2>&1 | tee $OUT/gpu-check.log
#
# Build: with cargo, it builds here (release, --features native-nccl). Without cargo (the lent
# device machine has no Rust and no network), or with GPU_CHECK_PREBUILT=1, it runs the programs
# of .gpu-bundle/, made beforehand by scripts/gpu-bundle.sh on a machine with Rust and carried
# along (it holds the Vulkan loader package too).
# NCCL: cudarc loads libnccl.so; NCCL ships libnccl.so.2 (for example in the pip wheel
# nvidia-nccl-cu13: site-packages/nvidia/nccl/lib). This script finds such a folder through python3
# when none is on the loader path and adds a libnccl.so symlink next to a copy of it.
# Vulkan: without a loader on the machine it unpacks the bundle's libvulkan1; where the NVIDIA
# driver's ICD file sits under /usr/local/nvidia (as on the lent machine) it points Vulkan at it.
set -uo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/distgrad-target}"
status=0
bundle=.gpu-bundle

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

if [ "${GPU_CHECK_PREBUILT:-0}" = 1 ] || ! command -v cargo >/dev/null; then
  if [ ! -x "$bundle/bin/distgrad" ]; then
    echo "gpu-check: no cargo here and no $bundle: run scripts/gpu-bundle.sh on a machine with Rust and bring $bundle along" >&2
    exit 1
  fi
  echo "gpu-check: prebuilt programs of commit $(cat "$bundle/commit" 2>/dev/null) (this tree: $(git rev-parse HEAD 2>/dev/null || echo unknown))"
  dg="$bundle/bin/distgrad"
  run_test() { local t=$1; shift; "$bundle/bin/test-$t" "$@"; }
else
  echo "== build (release, --features native-nccl)"
  cargo build --release --locked --features native-nccl || exit 1
  dg="$CARGO_TARGET_DIR/release/distgrad"
  run_test() { local t=$1; shift; cargo test --release --locked --features native-nccl --test "$t" -- "$@"; }
fi

has_vulkan() { ldconfig -p 2>/dev/null | grep -q 'libvulkan.so.1 '; }
if ! has_vulkan && ls "$bundle"/deb/*.deb >/dev/null 2>&1; then
  echo "gpu-check: installing the bundled Vulkan loader"
  for f in "$bundle"/deb/*.deb; do dpkg -x "$f" /; done
  ldconfig
fi
nv_icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f "$nv_icd" ]; then
  export VK_DRIVER_FILES="$nv_icd"
fi

if ! ldconfig -p 2>/dev/null | grep -q 'libnccl.so '; then
  lib=$(python3 - <<'PY' 2>/dev/null
import glob, os, site, sys
roots = site.getsitepackages() + [site.getusersitepackages()] + sys.path
for r in roots:
    for p in glob.glob(os.path.join(r, "nvidia", "nccl", "lib", "libnccl.so*")):
        print(os.path.dirname(p)); raise SystemExit
PY
)
  if [ -n "${lib:-}" ]; then
    shim="${TMPDIR:-/tmp}/distgrad-nccl-lib"
    mkdir -p "$shim"
    ln -sf "$lib"/libnccl.so.2 "$shim/libnccl.so"
    export LD_LIBRARY_PATH="$shim:$lib:${LD_LIBRARY_PATH:-}"
    echo "gpu-check: using NCCL from $lib"
  else
    echo "gpu-check: no libnccl.so found (install NCCL or the nvidia-nccl wheel); NCCL checks will say so"
  fi
fi

echo "== NCCL tests"
run_test nccl --nocapture --test-threads 1 2>&1 \
  | grep -E "skipped|NCCL .*==|shared path|^test |test result|panicked|expected" || status=1

gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
world=$(( gpus < 1 ? 1 : (gpus > 8 ? 8 : gpus) ))
echo "== distgrad train --backend nccl --world $world"
"$dg" train --backend nccl --world "$world" --steps 200 || status=1
if has_vulkan; then
  echo "== the same with wgpu tensors and the shared data path (Vulkan memory imported into CUDA)"
  "$dg" train --backend nccl --data-path shared --world "$world" --steps 200 || status=1
fi
echo "== the same on in-process ranks (reference)"
"$dg" train --backend local --world "$world" --steps 200 | tail -2
echo "== NCCL all_reduce 1 KiB .. 1 GiB: CUDA buffers vs host staging vs shared wgpu memory, beside the device copy"
path=staging
has_vulkan && path=shared
"$dg" bench --transport nccl --world "$world" --data-path "$path" \
  --min-bytes 1024 --max-bytes 1073741824 || status=1

if has_vulkan; then
  echo "== WGSL kernel and shared-memory tests on the real adapter"
  for t in gpu_kernels gpu_export; do
    DISTGRAD_REQUIRE_GPU=1 run_test "$t" --nocapture --test-threads 1 2>&1 \
      | grep -E "adapter:|^test |test result|panicked" || status=1
  done
  echo "== kernel benchmark"
  "$dg" bench kernels || status=1
else
  echo "gpu-check: no Vulkan loader (libvulkan.so.1): WGSL checks skipped; install libvulkan1"
fi
exit $status
