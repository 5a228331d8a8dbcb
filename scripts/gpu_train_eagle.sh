#!/usr/bin/env bash
# scripts/gpu_train_eagle.sh [MINUTES] — train the default model's EAGLE-3 head on a GPU.
#
# The head shipped in speculators/heads/ had 230 minutes of 2 CPU cores (~2.9M tokens);
# the EAGLE papers train on ~100M. On one GPU a few minutes give that many. This script:
#
# 1. installs the package into the Python that holds torch: from the package index where
#    there is one, else offline (--no-index --no-deps), as on a machine that reaches
#    nothing and has torch and transformers already; wheels in .whl/ (what that Python
#    lacks: on the device tool's H200 image gguf and msgspec) are installed first;
# 2. finds the model: GGUF_PARTS (a folder of the GGUF file's pieces, made here with
#    `split -b 45M model.gguf part.`; joined in name order and imported), else GGUF (the
#    file), else `codespec model fetch`;
# 3. trains for MINUTES (default 8) with `codespec train-eagle --device $DEVICE` on the
#    code in DATA (a folder of .py files; default: the stdlib's), then evaluates the head
#    on held-out stdlib tests: teacher-forced accuracy and real CPU decoding (per-position
#    acceptance, tokens per target forward);
# 4. copies the head (config.json, model.safetensors, training.json) to $OUT (the device
#    tool's folder) or runs/eagle-gpu-head. To ship it: replace the files in
#    speculators/heads/smollm2-135m-instruct/ and run the eagle benches.
#
# Not yet run on a GPU (no device was lent to the session that wrote it); tried with
# DEVICE=cpu end to end.
#
# Environment: DEVICE (cuda; DEVICE=cpu tries the script on a machine without a GPU),
# BATCH (rows of SEQ tokens a step; 32 and 2048 on a GPU, 2 and 256 on the CPU), DATA,
# GGUF, GGUF_PARTS, RUN (the run folder, runs/eagle-gpu; an existing checkpoint resumes).
set -euo pipefail
cd "$(dirname "$0")/.."
MINUTES=${1:-8}
DEVICE=${DEVICE:-cuda}
RUN=${RUN:-runs/eagle-gpu}
if [ "$DEVICE" = cpu ]; then BATCH=${BATCH:-2}; SEQ=${SEQ:-256}; else BATCH=${BATCH:-32}; SEQ=${SEQ:-2048}; fi
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1

PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
if [ -d .whl ]; then $PY -m pip install -q --no-index --no-deps .whl/*.whl; fi
if ! $PY -c "import codespec.daemon" 2>/dev/null; then
  $PY -m pip install -q -e . 2>/dev/null ||
    $PY -m pip install -q --no-index --no-deps --no-build-isolation -e .
fi
$PY - <<EOF
import sys, torch
if "$DEVICE" == "cuda" and not torch.cuda.is_available():
    sys.exit("gpu_train_eagle: torch %s sees no CUDA device" % torch.__version__)
where = torch.cuda.get_device_name(0) if "$DEVICE" == "cuda" else "the CPU"
print("gpu_train_eagle: %s, torch %s" % (where, torch.__version__))
EOF

if [ -n "${GGUF_PARTS:-}" ]; then
  GGUF=$(mktemp -d)/model.gguf
  cat "$GGUF_PARTS"/* > "$GGUF"
fi
if [ -n "${GGUF:-}" ]; then
  MODEL=$($PY -m codespec.daemon.cli model import "$GGUF" | tail -1)
else
  MODEL=$($PY -m codespec.daemon.cli model fetch | tail -1)
fi
echo "gpu_train_eagle: model $MODEL"

resume=()
[ -f "$RUN/checkpoint.pt" ] && resume=(--resume)
$PY -m codespec.daemon.cli train-eagle --model "$MODEL" ${DATA:+--data "$DATA"} \
  --device "$DEVICE" --out "$RUN" --minutes "$MINUTES" --steps 1000000 \
  --batch-size "$BATCH" --seq-len "$SEQ" --threads "$(nproc)" --checkpoint-every 200 \
  "${resume[@]}"

dest=${OUT:-runs/eagle-gpu-head}
mkdir -p "$dest"
cp "$RUN"/config.json "$RUN"/model.safetensors "$RUN"/training.json "$dest"/
echo "gpu_train_eagle: the head is in $dest ($(du -sh "$dest" | cut -f1))"
