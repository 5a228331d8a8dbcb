#!/usr/bin/env bash
# scripts/gpu_train_eagle.sh [MINUTES] — train SmolLM2's EAGLE-3 head on a GPU.
#
# The head shipped in speculators/heads/ is trained on 2 CPU cores, on a few million
# tokens (its training.json), where the EAGLE papers train on ~100M. On one GPU a few
# minutes give that many. This script:
#
# 1-2. installs codespec and finds the model (CODESPEC_MODEL, smollm2-135m: the one whose
#    head ships) as scripts/gpu_env.sh says (offline
#    too: wheels in .whl/, the GGUF carried in pieces in GGUF_PARTS);
# 3. trains for MINUTES (default 8) with `codespec train-eagle --device $DEVICE` on the
#    code in DATA (a folder of .py files; default: the stdlib's), then evaluates the head
#    on held-out stdlib tests: teacher-forced accuracy and real CPU decoding (per-position
#    acceptance, tokens per target forward);
# 4. copies the head (config.json, model.safetensors, training.json) to $OUT (the device
#    tool's folder) or runs/eagle-gpu-head. To ship it: replace the files in
#    speculators/heads/smollm2-135m-instruct/ and run the eagle benches.
#
# Untested on a GPU; DEVICE=cpu runs it end to end.
#
# Environment: DEVICE (cuda; DEVICE=cpu tries the script on a machine without a GPU),
# BATCH (rows of SEQ tokens a step; 32 and 2048 on a GPU, 2 and 256 on the CPU), DATA,
# GGUF and GGUF_PARTS (see gpu_env.sh), RUN (the run folder, runs/eagle-gpu; a checkpoint
# there resumes).
set -euo pipefail
cd "$(dirname "$0")/.."
MINUTES=${1:-8}
DEVICE=${DEVICE:-cuda}
RUN=${RUN:-runs/eagle-gpu}
if [ "$DEVICE" = cpu ]; then BATCH=${BATCH:-2}; SEQ=${SEQ:-256}; else BATCH=${BATCH:-32}; SEQ=${SEQ:-2048}; fi
# shellcheck source=scripts/gpu_env.sh
. scripts/gpu_env.sh

resume=()
[ -f "$RUN/checkpoint.pt" ] && resume=(--resume)
"$PY" -m codespec.daemon.cli train-eagle --model "$MODEL" ${DATA:+--data "$DATA"} \
  --device "$DEVICE" --out "$RUN" --minutes "$MINUTES" --steps 1000000 \
  --batch-size "$BATCH" --seq-len "$SEQ" --threads "$(nproc)" --checkpoint-every 200 \
  "${resume[@]}"

dest=${OUT:-runs/eagle-gpu-head}
mkdir -p "$dest"
cp "$RUN"/config.json "$RUN"/model.safetensors "$RUN"/training.json "$dest"/
echo "gpu_train_eagle: the head is in $dest ($(du -sh "$dest" | cut -f1))"
