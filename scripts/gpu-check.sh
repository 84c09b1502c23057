#!/usr/bin/env bash
# GPU check on a machine with an NVIDIA GPU: the WGSL backend (Vulkan) and the NCCL target, in
# order of what matters most (each step under its own time limit, so a hang costs one step):
#   1. the NCCL tests (every collective forward + backward on NCCL vs the in-process group; bad
#      calls; mismatch detection with 2+ GPUs; staging and the shared Vulkan/CUDA data path);
#   2. the WGSL kernel, tensor and exported-memory tests on the real adapter;
#   3. `distgrad bench kernels` at 16M, 64M and 256M f32 (GB/s and the ratio to the device's own
#      copy);
#   4. the in-process 4-rank all_reduce with tensors on the GPU beside the CPU figure, with the
#      bytes each call reads back;
#   5. the NCCL all_reduce benchmark (1 KiB .. 1 GiB: CUDA buffers, host staging, shared wgpu
#      memory, beside the device copy) and torch.distributed's NCCL all_reduce on the same GPU
#      (scripts/nccl-baseline.py), with the ratios;
#   6. `distgrad train --backend nccl` (host tensors, then wgpu tensors over the shared path) and
#      the in-process reference;
#   7. the collective gradient suites (grad_hand, grad_fd, grad_adjoint) on the GPU backend;
#   8. the program with no subcommand (its demo: NCCL training on every GPU).
# Sized to finish in about six minutes on one H200.
#
#   scripts/gpu-check.sh            # from the repository root
#   set -o pipefail; scripts/gpu-check.sh 2>&1 | tee gpu-check.log   # keep the log (see results/h200-2026-12-04/)
#
# Build: it runs the programs of .gpu-bundle/ (scripts/gpu-bundle.sh). With cargo (and without
# GPU_CHECK_PREBUILT=1) it builds that bundle here first. A GPU machine without Rust (or without
# network) runs a bundle made beforehand on a machine with Rust: scripts/gpu-bundle.sh there, then
# copy the working tree with .gpu-bundle/ (which holds the Vulkan loader packages too) to the GPU
# machine and run this script there.
# NCCL: cudarc loads libnccl.so; NCCL ships libnccl.so.2 (for example in the pip wheel
# nvidia-nccl-cu13: site-packages/nvidia/nccl/lib). This script finds such a folder through python3
# when none is on the loader path and adds a libnccl.so symlink next to a copy of it.
# Vulkan: without a loader on the machine it unpacks the bundle's libvulkan1; where the NVIDIA
# driver's ICD file sits under /usr/local/nvidia (as on the H200 machine of 2026-12-04) it points
# Vulkan at it.
set -uo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/distgrad-target}"
status=0
bundle=.gpu-bundle

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

if [ "${GPU_CHECK_PREBUILT:-0}" != 1 ] && command -v cargo >/dev/null; then
  echo "== build the bundle here (release, --features native-nccl)"
  GPU_BUNDLE_LOCAL=1 scripts/gpu-bundle.sh || exit 1
fi
if [ ! -x "$bundle/bin/distgrad" ]; then
  echo "gpu-check: no cargo here and no $bundle: run scripts/gpu-bundle.sh on a machine with Rust and bring $bundle along" >&2
  exit 1
fi
echo "gpu-check: programs of commit $(cat "$bundle/commit" 2>/dev/null) (this tree: $(git rev-parse HEAD 2>/dev/null || echo unknown))"
dg="$bundle/bin/distgrad"
tb() { printf '%s\n' "$bundle/bin/test-$1"; }

# Vulkan: the loader (libvulkan1) and, for the NVIDIA ICD (libGLX_nvidia), libglvnd's libraries;
# the bundle carries their packages for a machine that lacks them.
for pkg in "libvulkan.so.1:libvulkan1" "libGLdispatch.so.0:libglvnd0" "libEGL.so.1:libegl1" \
  "libGLX.so.0:libglx0" "libGL.so.1:libgl1" "libOpenGL.so.0:libopengl0" "libGLESv2.so.2:libgles2"; do
  so=${pkg%%:*} deb=${pkg#*:}
  if ! ldconfig -p 2>/dev/null | grep -q "$so "; then
    for f in "$bundle"/deb/"${deb}"_*.deb; do
      [ -f "$f" ] && { echo "gpu-check: installing the bundled $deb"; dpkg -x "$f" /; }
    done
  fi
done
ldconfig 2>/dev/null
nv_icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f "$nv_icd" ]; then
  export VK_DRIVER_FILES="$nv_icd"
fi
nv_egl=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
[ -f "$nv_egl" ] && export __EGL_VENDOR_LIBRARY_FILENAMES="$nv_egl"
# Whether wgpu finds an adapter: a tiny kernel benchmark; when it does not, the loader says why.
if "$dg" bench kernels --elements 1K >/dev/null 2>&1; then
  vulkan_ok=1
  echo "gpu-check: Vulkan adapter: $("$dg" bench kernels --elements 1K 2>/dev/null | head -1)"
else
  vulkan_ok=0
  echo "gpu-check: no Vulkan adapter for wgpu; the loader's account (VK_DRIVER_FILES=${VK_DRIVER_FILES:-unset}):"
  ls -l /usr/local/nvidia/share/vulkan/icd.d/ 2>&1 | head -5
  cat "$nv_icd" 2>/dev/null | head -20
  VK_LOADER_DEBUG=error,warn,driver "$dg" bench kernels --elements 1K 2>&1 | head -40
fi
has_vulkan() { [ "$vulkan_ok" = 1 ]; }

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

# GPU_CHECK_STEPS: the steps to run (digits, default all: 12345678), e.g. 3 for the kernel
# benchmark alone on a rerun.
want() { case "${GPU_CHECK_STEPS:-12345678}" in *"$1"*) return 0 ;; esac; return 1; }
step() { printf '\n== %s (%s)\n' "$1" "$(date +%H:%M:%S)"; }
# Run a step's command under a time limit; a failure or a timeout marks the check failed.
limit() {
  local secs=$1; shift
  timeout --kill-after=5 "$secs" "$@"
  local rc=$?
  [ $rc -eq 124 ] && echo "gpu-check: timed out after ${secs} s: $*"
  [ $rc -ne 0 ] && status=1
  return 0
}
# GPU_CHECK_QUICK=1: small sizes everywhere, to try this script itself on a machine without a GPU
# (lavapipe) before running it on a GPU machine.
if [ "${GPU_CHECK_QUICK:-0}" = 1 ]; then
  kernel_elems=64K,1M coll_max=1048576 nccl_max=4194304 steps=20
else
  kernel_elems=16M,64M,256M coll_max=67108864 nccl_max=1073741824 steps=200
fi
tmp=${TMPDIR:-/tmp}/distgrad-gpu-check
mkdir -p "$tmp"

if want 1; then
  step "1. NCCL tests"
  limit 180 "$(tb nccl)" --nocapture --test-threads 1 > "$tmp/nccl.log" 2>&1
  grep -E "skipped|NCCL|shared path|^test |test result|panicked|expected|error" "$tmp/nccl.log"
fi

if ! has_vulkan; then
  echo "gpu-check: no Vulkan adapter: the WGSL steps (2, 3, 4, 7) are skipped"
fi
if has_vulkan && want 2; then
  step "2. WGSL kernel, tensor and exported-memory tests on the real adapter"
  for t in gpu_kernels gpu_tensor gpu_export; do
    DISTGRAD_REQUIRE_GPU=1 limit 90 "$(tb "$t")" --nocapture --test-threads 2 > "$tmp/$t.log" 2>&1
    grep -E "adapter:|^test .*(FAILED|ignored)|test result|panicked" "$tmp/$t.log"
  done
fi
if has_vulkan && want 3; then
  step "3. kernel benchmark ($kernel_elems f32 per input)"
  limit 120 "$dg" bench kernels --elements "$kernel_elems"
fi
if has_vulkan && want 4; then
  step "4. in-process all_reduce, 4 ranks: tensors on the GPU, then on the CPU"
  limit 90 "$dg" bench --world 4 --ops all_reduce --min-bytes 1024 --max-bytes "$coll_max" --device gpu
  limit 60 "$dg" bench --world 4 --ops all_reduce --min-bytes 1024 --max-bytes "$coll_max"
fi

gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
world=$(( gpus < 1 ? 1 : (gpus > 8 ? 8 : gpus) ))
if want 5; then
  step "5. NCCL all_reduce 1 KiB .. 1 GiB (world $world): CUDA buffers vs host staging vs shared wgpu memory, beside the device copy; then torch.distributed"
  path=staging
  has_vulkan && path=shared
  limit 180 "$dg" bench --transport nccl --world "$world" --data-path "$path" \
    --min-bytes 1024 --max-bytes "$nccl_max" > "$tmp/nccl-bench.txt" 2>&1
  cat "$tmp/nccl-bench.txt"
  if python3 -c "import torch.distributed" 2>/dev/null; then
    PYTHONUNBUFFERED=1 limit 150 python3 scripts/nccl-baseline.py --world "$world" \
      --min-bytes 1024 --max-bytes "$nccl_max" --distgrad "$tmp/nccl-bench.txt"
  else
    echo "gpu-check: no torch here: the torch.distributed baseline is skipped"
  fi
fi

if want 6; then
  step "6. distgrad train --backend nccl --world $world"
  limit 90 "$dg" train --backend nccl --world "$world" --steps "$steps"
  if has_vulkan; then
    echo "-- the same with wgpu tensors and the shared data path (Vulkan memory imported into CUDA)"
    limit 90 "$dg" train --backend nccl --data-path shared --world "$world" --steps "$steps"
  fi
  echo "-- the same on in-process ranks (reference)"
  limit 60 "$dg" train --backend local --world "$world" --steps "$steps" > "$tmp/train-local.txt" 2>&1
  tail -3 "$tmp/train-local.txt"
fi

if has_vulkan && want 7; then
  step "7. collective gradient suites on the GPU backend (the ::gpu tests)"
  for t in grad_hand grad_adjoint grad_fd; do
    DISTGRAD_REQUIRE_GPU=1 limit 120 "$(tb "$t")" ::gpu --test-threads 2 > "$tmp/$t.log" 2>&1
    grep -E "^test .*(FAILED|ignored)|test result|panicked" "$tmp/$t.log"
  done
fi
if want 8; then
  step "8. the bare program (\`cargo run --release --features native-nccl\` with no subcommand)"
  limit 90 "$dg"
fi
step "done: status $status"
exit $status
