#!/usr/bin/env bash
# Build the web app and serve it with the relay from one process on 127.0.0.1:8080 (or $PORT):
# open the printed URL, then the share link it shows in as many tabs as the world size.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/distgrad-target}"
source scripts/web-tools.sh
trunk build --release
cargo build --release --locked --bin distgrad
port="${PORT:-8080}"
echo "open http://127.0.0.1:$port/?world=${WORLD:-4}"
# The page comes from the relay itself: its own origin, the only one a relay takes by default
# (named anyway, so that a page opened under either name is taken whatever Host a proxy sends).
exec "$CARGO_TARGET_DIR/release/distgrad" relay --addr "127.0.0.1:$port" --static dist \
  --allowed-origin "http://127.0.0.1:$port,http://localhost:$port"
