#!/usr/bin/env bash
# Every test: the native suite (`cargo test`, GPU tests on lavapipe) and the browser suite
# (wasm-bindgen-test in headless Chromium with WebGPU). Installs what it needs, skipping what is
# already there: lavapipe, chromium + chromium-driver (apt, as root), the wasm32 target, and
# wasm-bindgen-cli at exactly the version in Cargo.lock.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/distgrad-target}"

say() { printf '\n-- %s\n' "$1"; }

apt_need=()
for p in mesa-vulkan-drivers libvulkan1 chromium chromium-driver; do
  dpkg -s "$p" >/dev/null 2>&1 || apt_need+=("$p")
done
if [ ${#apt_need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    say "installing ${apt_need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apt_need[@]}"
  else
    echo "missing ${apt_need[*]}: install them as root (GPU tests then report 'skipped', browser tests fail)"
  fi
fi
if dpkg -s mesa-vulkan-drivers >/dev/null 2>&1; then
  # lavapipe is installed, so a missing adapter is a failure, not a skip.
  export DISTGRAD_REQUIRE_GPU=1
fi

say "native tests"
cargo test --locked

say "browser tests (headless Chromium, WebGPU)"
if command -v rustup >/dev/null; then
  rustup target list --installed | grep -q '^wasm32-unknown-unknown' || rustup target add wasm32-unknown-unknown
fi
wbg=$(awk '/^name = "wasm-bindgen"$/ { getline; gsub(/version = |"/, ""); print; exit }' Cargo.lock)
if [ "$(wasm-bindgen --version 2>/dev/null | awk '{print $2}')" != "$wbg" ]; then
  say "installing wasm-bindgen-cli $wbg (a few minutes, once)"
  cargo install wasm-bindgen-cli --version "$wbg"
fi
cargo test --locked --target wasm32-unknown-unknown --test browser_kernels
