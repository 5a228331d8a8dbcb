#!/usr/bin/env bash
# scripts/bench_view.sh [bench latency flags...] — the live view's cost on typing latency.
#
# Runs `codespec bench latency --configs` on two daemons, side by side in alternating
# rounds: view_off (no view: nothing records, nothing listens) and view_on ([view]
# enabled = true: every request recorded into the ring, and a page reading the view's
# event stream, as an open browser tab does). Extra flags go to bench latency
# (e.g. --rounds 4 --model smollm2-135m --threads 2).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
printf '[view]\nenabled = false\n' >"$DIR/view_off.toml"
printf '[view]\nenabled = true\n' >"$DIR/view_on.toml"
exec_python=${PYTHON:-python}
"$exec_python" -m codespec.daemon.cli bench latency \
  --configs "$DIR/view_off.toml,$DIR/view_on.toml" "$@"
