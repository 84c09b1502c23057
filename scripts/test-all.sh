#!/usr/bin/env bash
# Every test: the native suite (`cargo test`, GPU tests on lavapipe), the browser unit suite
# (wasm-bindgen-test in headless Chromium with WebGPU) and the end-to-end suites: the web app built
# with trunk, 4 tabs as ranks over the relay, over BroadcastChannels (no port hub), with the
# page's automatic choice (MessageChannels from the port hub) and over WebRTC, a mixed native +
# browser group, a tab closed mid-run, every lesson of the teaching demo in 3 tabs and in
# single-tab mode, and the shipped programs run and their gradients checked in 3 tabs and in
# single-tab mode against the native CLI.
# Hidden tabs (a headful Chromium under Xvfb, the ranks' tabs behind a blank one) against visible
# ones measured in turns: 1 MiB all_reduce, a 200-step lesson and lesson playback, again after both
# rooms idled 6 minutes; and that idle tabs cost no CPU.
# Installs what it needs, skipping what is already there: lavapipe, chromium + chromium-driver,
# iproute2 and xvfb (apt, as root), the wasm32 target, wasm-bindgen-cli at exactly the version in
# Cargo.lock, trunk, and the npm packages of tests/browser (scripts/web-tools.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/distgrad-target}"

say() { printf '\n-- %s\n' "$1"; }

apt_need=()
for p in mesa-vulkan-drivers libvulkan1 chromium chromium-driver iproute2 xvfb xauth; do
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

say "examples (each checks its own result: gradients across ranks, data parallel vs one device)"
cargo run --locked -q --example gradcheck_custom
cargo run --locked -q --example data_parallel

say "NCCL target (feature native-nccl; GPU checks say 'skipped: no CUDA device' without one)"
cargo test --locked --features native-nccl --test nccl --test train -- --nocapture 2>&1 \
  | grep -E "skipped|NCCL ==|as expected|NCCL present|^test |test result|panicked|error|warning"

say "browser tools"
source scripts/web-tools.sh

say "browser unit tests (headless Chromium, WebGPU)"
cargo test --locked --target wasm32-unknown-unknown --test browser_kernels

say "end-to-end: the web app in 4 tabs (tests/browser/e2e.mjs)"
trunk build --release
cargo build --locked --bin distgrad
bin="$CARGO_TARGET_DIR/debug/distgrad"
out="$CARGO_TARGET_DIR/browser-test-output"
# WebGPU (SwiftShader) tabs, asked for with device=gpu: the page's own choice takes the CPU over a
# software adapter (the last run checks that).
say "the page's budget: release .wasm under 2 MB (checked), the first lesson's time in single-tab mode (printed)"
node tests/browser/startup.mjs --bin "$bin" --dist dist
node tests/browser/e2e.mjs --bin "$bin" --dist dist --net relay --device gpu --out "$out"
# Tabs of one browser over BroadcastChannels, without the port hub (ports=0: what a browser without
# SharedWorker does; no network between them; the native worker of the mixed-group check keeps the
# relay).
node tests/browser/e2e.mjs --bin "$bin" --dist dist --net channel --device gpu --ports 0 --out "$out"
# The page's defaults (net=auto, device=auto): these tabs, all in one browser, find each other on
# BroadcastChannels and move to the port hub's MessageChannels, and pick the CPU; the native
# worker's pairs try WebRTC after the channel's 2 s and keep the relay.
node tests/browser/e2e.mjs --bin "$bin" --dist dist --net auto --out "$out"
say "the room benchmark, repeated in fresh tabs (tests/browser/bench.mjs; figures, not asserted)"
node tests/browser/bench.mjs --bin "$bin" --dist dist --net channel --device gpu --ports both --runs 2
say "end-to-end: every lesson of the teaching demo in 3 tabs and in single-tab mode (tests/browser/lessons.mjs)"
node tests/browser/lessons.mjs --bin "$bin" --dist dist --out "$out"
say "end-to-end: the algorithm view, round by round, at 3, 4, 5 and 8 ranks and a phone's width (tests/browser/algorithm.mjs)"
node tests/browser/algorithm.mjs --bin "$bin" --dist dist --out "$out"
say "end-to-end: wrong vs right, the gradient check deciding, at 3, 4 and 8 ranks and a phone's width (tests/browser/duals.mjs)"
node tests/browser/duals.mjs --bin "$bin" --dist dist --out "$out"
say "end-to-end: values labelled invariant / varying / unreduced, the Megatron MLP lesson at 3, 4 and 8 ranks and a phone's width (tests/browser/kinds.mjs)"
node tests/browser/kinds.mjs --bin "$bin" --dist dist --out "$out"
say "end-to-end: one device beside the ranks' gradients, a lesson of each view at 3, 4 and 8 ranks and a phone's width (tests/browser/one_device.mjs)"
node tests/browser/one_device.mjs --bin "$bin" --dist dist --out "$out"
say "end-to-end: the first screen, links to a lesson step, projector mode, the compute line (tests/browser/teacher.mjs)"
node tests/browser/teacher.mjs --bin "$bin" --dist dist --out "$out"
say "end-to-end: the relay's admin page with a class of tabs: rooms, members, use, remove, close (tests/browser/admin.mjs)"
node tests/browser/admin.mjs --bin "$bin" --dist dist --out "$out"
say "end-to-end: programs and the gradient check in 3 tabs and in single-tab mode (tests/browser/programs.mjs)"
node tests/browser/programs.mjs --bin "$bin" --dist dist --out "$out"
say "end-to-end: hidden tabs against visible ones, over MessageChannels (net=channel) and the relay (tests/browser/hidden.mjs)"
# A real window system is needed for tabs that are really hidden: Xvfb unless there is a display.
# The script talks to Chromium over its DevTools socket (Node's WebSocket: a flag before Node 22).
ws_flag=()
node -e 'process.exit(typeof WebSocket === "undefined" ? 1 : 0)' || ws_flag=(--experimental-websocket)
hidden() {
  if [ -n "${DISPLAY:-}" ]; then
    node "${ws_flag[@]}" tests/browser/hidden.mjs --bin "$bin" --dist dist --out "$out" "$@"
  elif command -v xvfb-run >/dev/null; then
    xvfb-run -a -s "-screen 0 1700x1300x24" \
      node "${ws_flag[@]}" tests/browser/hidden.mjs --bin "$bin" --dist dist --out "$out" "$@"
  else
    echo "SKIPPED: the hidden-tab run needs a display or xvfb-run (apt-get install xvfb as root)"
  fi
}
hidden --net channel --hidden-wait 360
hidden --net relay --hidden-wait 0
# WebRTC only inside a loopback-only network namespace, so ICE never tries another interface.
if unshare -n true 2>/dev/null; then
  unshare -n sh -c 'ip link set lo up && exec node tests/browser/e2e.mjs --bin "$0" --dist dist --net webrtc --device gpu --out "$1"' "$bin" "$out"
elif unshare -rn true 2>/dev/null; then
  unshare -rn sh -c 'ip link set lo up && exec node tests/browser/e2e.mjs --bin "$0" --dist dist --net webrtc --device gpu --out "$1"' "$bin" "$out"
else
  echo "SKIPPED: the WebRTC end-to-end run needs a network namespace (unshare -n: run as root or enable user namespaces)"
fi
echo "screenshots: $out"
