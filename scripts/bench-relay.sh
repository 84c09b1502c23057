#!/usr/bin/env bash
# Side-by-side relay figures: PyTorch's gloo, `distgrad bench --transport relay` (data streams on
# the relay's Unix-domain socket) and `--transport relay-tcp` (streams over TCP), back to back in
# each of ROUNDS rounds, at 2 and 4 ranks: the all_reduce at SIZE bytes per rank and the 16-byte
# latency. Alternating keeps the three under the same machine load; compare within a round. The
# ranks are processes on every side (distgrad's `bench --processes`), as gloo's are.
#
#   PYTHON=/opt/gloo-venv/bin/python scripts/bench-relay.sh        # needs torch in that python
#
# Env: PYTHON (default python3), DISTGRAD (default: the release binary, `cargo build`-ed first),
# ROUNDS (3), SIZE (16777216), WORLDS ("2 4").
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
ROUNDS=${ROUNDS:-3}
SIZE=${SIZE:-16777216}
WORLDS=${WORLDS:-2 4}
if [[ -z "${DISTGRAD:-}" ]]; then
    cargo build --release --locked --bin distgrad >&2
    DISTGRAD="${CARGO_TARGET_DIR:-target}/release/distgrad"
fi
if ! "$PYTHON" -c 'import torch' 2>/dev/null; then
    echo "bench-relay: $PYTHON has no torch; set PYTHON to one that has (see scripts/gloo-baseline.py)" >&2
    exit 2
fi
# One line per run: what, world, busbw at SIZE, 16-byte p50.
summary() {
    awk -v what="$1" -v world="$2" '
        / all_reduce / && NF >= 6 && $5 + 0 > 0 { bw = $6 }
        /p50/ { for (i = 1; i <= NF; i++) if ($i == "p50") { p50 = $(i + 1) " " $(i + 2); sub(/,$/, "", p50) } }
        END { printf "%-10s world %s  busbw %s GB/s  p50 %s\n", what, world, bw, p50 }'
}
for r in $(seq "$ROUNDS"); do
    echo "# round $r"
    for w in $WORLDS; do
        timeout 300 "$PYTHON" scripts/gloo-baseline.py --world "$w" --min-bytes "$SIZE" \
            --max-bytes "$SIZE" 2>&1 | summary gloo "$w"
        for t in relay relay-tcp; do
            timeout 300 "$DISTGRAD" bench --processes --transport "$t" --world "$w" --min-bytes "$SIZE" \
                --max-bytes "$SIZE" --ops all_reduce 2>&1 | summary "$t" "$w"
        done
    done
done
