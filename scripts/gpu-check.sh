#!/usr/bin/env bash
# GPU check on a machine with an NVIDIA GPU: the WGSL backend (Vulkan) and the NCCL target.
# Builds with --features native-nccl, runs the kernel tests on the real adapter, the NCCL tests
# (every collective forward + backward on NCCL vs the in-process group; mismatch detection with 2+
# GPUs), `distgrad train --backend nccl` on every GPU (up to 8), the NCCL all_reduce benchmark
# (1 KiB .. 1 GiB, GPU-resident vs host-staged, beside the device copy bandwidth) and the kernel
# benchmark, printing figures. Sized to finish in a few minutes.
#
#   scripts/gpu-check.sh            # from the repository root
#
# NCCL: cudarc loads libnccl.so; NCCL ships libnccl.so.2 (for example in the pip wheel
# nvidia-nccl-cu13: site-packages/nvidia/nccl/lib). This script finds such a folder through python3
# when none is on the loader path and adds a libnccl.so symlink next to a copy of it.
# Vulkan: on the lent machine the loader may be missing (install libvulkan1); if no driver is found,
# export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
set -uo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/distgrad-target}"
status=0

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

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
    shim="$CARGO_TARGET_DIR/nccl-lib"
    mkdir -p "$shim"
    ln -sf "$lib"/libnccl.so.2 "$shim/libnccl.so"
    export LD_LIBRARY_PATH="$shim:$lib:${LD_LIBRARY_PATH:-}"
    echo "gpu-check: using NCCL from $lib"
  else
    echo "gpu-check: no libnccl.so found (install NCCL or the nvidia-nccl wheel); NCCL checks will say so"
  fi
fi

echo "== build (release, --features native-nccl)"
cargo build --release --locked --features native-nccl || exit 1

echo "== NCCL tests"
cargo test --release --locked --features native-nccl --test nccl -- --nocapture --test-threads 1 2>&1 \
  | grep -E "skipped|NCCL ==|^test |test result|panicked|expected" || status=1

gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
world=$(( gpus < 1 ? 1 : (gpus > 8 ? 8 : gpus) ))
echo "== distgrad train --backend nccl --world $world"
"$CARGO_TARGET_DIR/release/distgrad" train --backend nccl --world "$world" --steps 200 || status=1
echo "== the same on in-process ranks (reference)"
"$CARGO_TARGET_DIR/release/distgrad" train --backend local --world "$world" --steps 200 | tail -2
echo "== NCCL all_reduce 1 KiB .. 1 GiB: GPU-resident buffers vs host staging, beside the device copy"
"$CARGO_TARGET_DIR/release/distgrad" bench --transport nccl --world "$world" \
  --min-bytes 1024 --max-bytes 1073741824 || status=1

if ldconfig -p 2>/dev/null | grep -q libvulkan; then
  echo "== WGSL kernel tests on the real adapter"
  DISTGRAD_REQUIRE_GPU=1 cargo test --release --locked --test gpu_kernels -- --nocapture --test-threads 1 2>&1 \
    | grep -E "adapter:|^test |test result" || status=1
  echo "== kernel benchmark"
  "$CARGO_TARGET_DIR/release/distgrad" bench kernels || status=1
else
  echo "gpu-check: no Vulkan loader (libvulkan.so.1): WGSL checks skipped; install libvulkan1"
fi
exit $status
