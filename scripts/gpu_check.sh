#!/usr/bin/env bash
# scripts/gpu_check.sh [WORKLOAD_DIR] — the GPU path's check, for a machine with CUDA.
#
# Installs what it needs and finds the model (CODESPEC_MODEL, smollm2-135m: the one whose
# EAGLE head ships) as scripts/gpu_env.sh says (a
# CUDA build of torch into .venv unless python3 has one; offline too, with wheels in
# .whl/ and the GGUF carried in pieces in GGUF_PARTS), then on the GPU, for each workload
# (completion, edit, novel; made by `codespec bench make-workloads` into
# WORKLOAD_DIR when it holds none): every method side by side (off, ngram,
# lookahead, auto, and eagle and auto-eagle when the model has a head), their per-token ms and
# speedup over off, and a check that every method's output equals off's token
# for token. Exits 1 when one does not, or when there is no CUDA device.
#
# Environment: LIMIT (prompts per workload, 8), MAX_TOKENS (per prompt, 128), DEVICE
# (cuda; DEVICE=cpu runs the same checks on the CPU, which is how the script itself is
# tried on a machine without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
WL=${1:-/tmp/wl}
LIMIT=${LIMIT:-8}
MAX_TOKENS=${MAX_TOKENS:-128}
DEVICE=${DEVICE:-cuda}
# shellcheck source=scripts/gpu_env.sh
. scripts/gpu_env.sh
[ -f "$WL/novel.jsonl" ] || "$PY" -m codespec.daemon.cli bench make-workloads --out "$WL"

methods=off,ngram,lookahead,auto
if DEVICE=$DEVICE "$PY" - <<'EOF' 2>/dev/null; then
import os
import sys
from codespec.daemon.engine.engine import Engine
from codespec.speculators.registry import build
try:
    build("eagle", Engine(device=os.environ["DEVICE"]))
except Exception:
    sys.exit(1)
EOF
  methods=$methods,eagle,auto-eagle  # auto-eagle: what auto gains from the head
fi

status=0
for kind in completion edit novel; do
  out=$(mktemp)
  "$PY" -m codespec.daemon.cli bench "$WL/$kind.jsonl" --methods "$methods" --limit "$LIMIT" \
    --max-tokens "$MAX_TOKENS" --device "$DEVICE" | tee "$out"
  "$PY" - "$out" "$kind" <<'EOF' || status=1
import json
import sys
path, kind = sys.argv[1], sys.argv[2]
result = json.loads(open(path).read().strip().splitlines()[-1])
bad = 0
for row in result["rows"]:
    if row["workload"] != "all":
        continue
    ms = row["decode_ms"] / max(1, row["tokens"])
    print(f"gpu_check {kind:10s} {row['method']:10s} {ms:7.2f} ms/token  "
          f"{row['tokens_per_forward']:.2f} tok/fwd  {row['decode_speedup_vs_off']:.2f}x decode  "
          f"{row['speedup_vs_off']:.2f}x wall  equal to off {row['equal_to_off']}/{row['prompts']}")
    bad += row["equal_to_off"] != row["prompts"]
sys.exit(1 if bad else 0)
EOF
  rm -f "$out"
done
[ "$status" = 0 ] && echo "gpu_check: every method equals off on every prompt" \
  || echo "gpu_check: FAILED: a method's output differs from off's"
exit "$status"
