#!/usr/bin/env bash
# GPU check for the WGSL backend on a machine with a real GPU (Vulkan): builds, runs the kernel test
# suite on the real adapter (a missing adapter is a failure here), then the kernel benchmark, and
# prints the figures. Sized to finish in a few minutes.
#
#   scripts/gpu-check.sh            # from the repository root
#
# On the lent NVIDIA machine the Vulkan loader may be missing: see the device notes (carry the
# libvulkan1 .deb and unpack it first) and, if no driver is found, export
# VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/distgrad-target}"

if ! ldconfig -p 2>/dev/null | grep -q libvulkan; then
  echo "gpu-check: no Vulkan loader (libvulkan.so.1) on this machine; install libvulkan1" >&2
  exit 1
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

echo "== build (release)"
cargo build --release --locked

echo "== WGSL kernel tests on the real adapter"
DISTGRAD_REQUIRE_GPU=1 cargo test --release --locked --test gpu_kernels -- --nocapture --test-threads 1 2>&1 \
  | grep -E "adapter:|^test |test result"

echo "== kernel benchmark"
"$CARGO_TARGET_DIR/release/distgrad" bench kernels
