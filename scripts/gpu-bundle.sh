#!/usr/bin/env bash
# Build the GPU check's programs on a machine with Rust, for a GPU machine without it:
# scripts/gpu-check.sh runs them there. Into .gpu-bundle/ (git-ignored) go the release `distgrad`
# binary and the test programs of tests/nccl.rs, gpu_kernels.rs, gpu_export.rs, gpu_tensor.rs and
# the gradient suites (grad_hand.rs, grad_adjoint.rs, grad_fd.rs), all built with
# --features native-nccl and stripped, plus the Debian packages of the Vulkan loader and
# libglvnd, which NVIDIA's Vulkan driver needs and a bare GPU machine may lack, and the commit
# they were built from. gpu-check.sh uses the bundle when `cargo` is missing or
# GPU_CHECK_PREBUILT=1 (with cargo it builds a local bundle itself: GPU_BUNDLE_LOCAL=1, no
# packages). The bundle is copied to the GPU machine with the working tree, so it is kept small:
# the sizes are printed, and a bundle of 60 MiB or more is an error.
#
#   scripts/gpu-bundle.sh           # from the repository root; then copy the tree with .gpu-bundle/
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/distgrad-target}"
out=.gpu-bundle
rm -rf "$out"
mkdir -p "$out/bin" "$out/deb"

echo "gpu-bundle: building (release, --features native-nccl)"
cargo build --release --locked --features native-nccl
cp "$CARGO_TARGET_DIR/release/distgrad" "$out/bin/distgrad"
# The test programs: cargo names them <test>-<hash>; ask it which files it built.
cargo test --release --locked --features native-nccl --no-run \
  --test nccl --test gpu_kernels --test gpu_export --test gpu_tensor \
  --test grad_hand --test grad_adjoint --test grad_fd --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])
' | while read -r name exe; do
  cp "$exe" "$out/bin/test-$name"
done
for t in nccl gpu_kernels gpu_export gpu_tensor grad_hand grad_adjoint grad_fd; do
  [ -x "$out/bin/test-$t" ] || { echo "gpu-bundle: test program $t was not built" >&2; exit 1; }
done
strip "$out"/bin/*

if [ "${GPU_BUNDLE_LOCAL:-0}" = 1 ]; then
  git rev-parse HEAD > "$out/commit" 2>/dev/null || echo unknown > "$out/commit"
  echo "gpu-bundle: built for this machine (GPU_BUNDLE_LOCAL=1: no loader package, no size limit)"
  exit 0
fi

# The Vulkan loader and libglvnd's libraries, which the NVIDIA Vulkan driver (libGLX_nvidia)
# loads: a bare GPU machine may have neither (seen on the H200 machine of 2026-12-04: without
# libglvnd, no Vulkan adapter).
echo "gpu-bundle: the Vulkan loader and libglvnd (the GPU machine may lack them)"
(cd "$out/deb" && apt-get download -qq libvulkan1 libglvnd0 libegl1 libgl1 libglx0 libopengl0 \
  libgles2 2>/dev/null) \
  || echo "gpu-bundle: could not download the loader packages (apt); the bundle may lack them"

git rev-parse HEAD > "$out/commit"
du -ah "$out" | sort -h | tail -8
total=$(du -sm "$out" | cut -f1)
if [ "$total" -ge 60 ]; then
  echo "gpu-bundle: ${total} MiB: the bundle must stay under 60 MiB (it travels with the working tree)" >&2
  exit 1
fi
echo "gpu-bundle: ${total} MiB in $out (commit $(cat "$out/commit"))"
