#!/usr/bin/env bash
# Build a separate environment with Mobilint's own vLLM plugin stack on the npusim.mxq simulator:
# vLLM 0.11.2 (the version vllm-mblt 0.8.0 pins; a CUDA wheel: no CPU build of its torch 2.9.0
# exists, and it imports and runs on a CPU-only host), vllm-mblt 0.8.0, transformers-mblt 0.6.1,
# mblt-npu-python 0.1.0 and mblt-model-zoo 2.13.0 (vllm-mblt imports mblt_model_zoo.hf_transformers,
# a facade over transformers-mblt), all unpatched; `import qbruntime` -> npusim.mxq through the alias.
# Its Qwen3-ASR model needs the `qwen-asr` extra: qwen-asr 0.0.6 (without its own dependencies: gradio,
# flask, accelerate... are for its demos) and what its `__init__` and vLLM's transcription endpoint
# import: librosa, soundfile and nagisa (with DyNet38), and theirs.
# The project's own plugin is NOT installed there (its platform entry point is also named `mblt`).
#
# With tools/vllm-mblt-env/lock.txt present (pip freeze of a built env) the script installs exactly
# those versions (--no-deps); LOCK=none resolves from vLLM 0.11.2's metadata instead (then write a
# new lock with: DIR/bin/python -m pip freeze > lock.txt).
#
# usage: tools/vllm-mblt-env/build.sh DIR      (~11 GB, 4-8 min on 2 cores; needs PyPI)
#   or:  npu-harness vendor-env mblt           (into ~/.cache/npu-harness/vendor-envs/, by digest)
# then:  npu-harness conformance --target mblt-sim --vendor   (the vllm-mblt@mblt-sim column), or
#        NPU_HARNESS_VLLM_MBLT_ENV=DIR ./dev test tests/vllm_npu/test_vllm_mblt_vendor.py
set -euo pipefail
[[ $# -eq 1 ]] || { echo "usage: $0 DIR" >&2; exit 2; }
ENV=$1
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-python3.11}
# shellcheck source=../vendor-env.sh
source "$ROOT/tools/vendor-env.sh"
"$PY" -m venv "$ENV"
PIP=("$ENV/bin/python" -m pip --disable-pip-version-check -q)
HERE=$(cd "$(dirname "$0")" && pwd)
LOCK=${LOCK:-$HERE/lock.txt}
if [[ "$LOCK" != none && -f "$LOCK" ]]; then
  # exactly the versions of a built environment (pip freeze), so a rebuild is the same env
  quiet "${PIP[@]}" install --no-deps -r "$LOCK"
else
  "${PIP[@]}" install "vllm==0.11.2"
  "${PIP[@]}" install --no-deps vllm-mblt==0.8.0 transformers-mblt==0.6.1 mblt-npu-python==0.1.0 mblt-model-zoo==2.13.0
  "${PIP[@]}" install librosa==0.11.0 soundfile==0.14.0 nagisa==0.2.11
  "${PIP[@]}" install --no-deps qwen-asr==0.0.6
fi
install_sim_hooks "$ENV" "$ROOT"
NPU_HARNESS_TARGET=mblt-sim "$ENV/bin/python" -c 'import qbruntime; assert qbruntime.__name__ == "npusim.mxq", qbruntime; print("qbruntime ->", qbruntime.__name__)'
