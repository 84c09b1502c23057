# Source this (bash): makes the web app's build tools available, installing what is missing, once:
# trunk 0.21.14 (cargo install, ~8 min), wasm-bindgen-cli at the Cargo.lock version, the wasm32
# target, and the npm packages of tests/browser (binaryen 132's wasm-opt, playwright-core).
# Trunk runs offline (Trunk.toml) and finds wasm-bindgen and wasm-opt on PATH.
# Needs: cargo (rustup), node + npm.

web_tools_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if command -v rustup >/dev/null; then
  rustup target list --installed | grep -q '^wasm32-unknown-unknown' || rustup target add wasm32-unknown-unknown
fi
wbg=$(awk '/^name = "wasm-bindgen"$/ { getline; gsub(/version = |"/, ""); print; exit }' "$web_tools_root/Cargo.lock")
if [ "$(wasm-bindgen --version 2>/dev/null | awk '{print $2}')" != "$wbg" ]; then
  echo "installing wasm-bindgen-cli $wbg (a few minutes, once)"
  cargo install wasm-bindgen-cli --version "$wbg"
fi
if [ "$(trunk --version 2>/dev/null | awk '{print $2}')" != "0.21.14" ]; then
  echo "installing trunk 0.21.14 (about 8 minutes, once)"
  cargo install trunk --version 0.21.14 --locked
fi
if ! command -v npm >/dev/null; then
  echo "npm not found: install Node.js 18+ (Debian: apt-get install nodejs npm)" >&2
  return 1 2>/dev/null || exit 1
fi
if [ ! -x "$web_tools_root/tests/browser/node_modules/.bin/wasm-opt" ] \
  || [ "$web_tools_root/tests/browser/package-lock.json" -nt "$web_tools_root/tests/browser/node_modules/.package-lock.json" ]; then
  echo "installing npm packages of tests/browser (binaryen 132, playwright-core)"
  (cd "$web_tools_root/tests/browser" && npm ci --no-audit --no-fund)
fi
export PATH="$web_tools_root/tests/browser/node_modules/.bin:$HOME/.cargo/bin:$PATH"
