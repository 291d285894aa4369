#!/usr/bin/env bash
# ci/pick-cc.sh [--arch ARCH] - print the C compiler command for the host build of kernels/ime2
# (`make -C kernels/ime2 CC="$(bash ci/pick-cc.sh)"`; ci/setup.sh does this).
#
#   ARCH  the host architecture: --arch, else $NPU_IME2_HOST_ARCH, else `uname -m`. Tests pass
#         --arch riscv64 on x86-64 to exercise the board's branch.
#
# riscv64 (the SpacemiT K3 board): the host build there is the K3 build, holding the IME2 path,
# which emits `.insn r` with vector registers. clang's integrated assembler accepts that, GNU as
# 2.40 rejects it (docs/boards.md), and the RVV intrinsics need a recent clang; so the compiler
# must be clang >= 19 (the version the IME2 encodings were checked with):
#   - $CC when it is set: used if `$CC --version` says clang >= 19, else an error naming it;
#   - else the newest clang >= 19 among the commands `clang` and `clang-<N>` on PATH
#     (first in PATH order on a tie), printed as an absolute path;
#   - none: an error naming what was found and the Debian/Ubuntu package (clang-19).
# Any other architecture: ${CC:-cc}, the compiler make uses by default (unchanged behaviour).
#
# Output: one line on stdout, the command. Exit status: 0 picked; 1 no usable compiler (message on
# stderr); 2 bad usage or a $CC that is not clang >= 19. Uses only bash builtins besides the
# candidate compilers themselves (and `uname` without --arch), so a test can run it with PATH
# holding nothing but fake compilers.
set -euo pipefail

MIN_CLANG=19
APT_PACKAGE=clang-19
ME="ci/pick-cc.sh"

die() { printf '%s: error: %s\n' "$ME" "$2" >&2; exit "$1"; }

# The clang major version `$@ --version` reports, or nothing (not clang, or it does not run).
clang_major() {
  local out
  out=$("$@" --version 2>/dev/null) || return 0
  if [[ $out =~ clang\ version\ ([0-9]+)\. ]]; then
    printf '%s' "${BASH_REMATCH[1]}"
  fi
}

# riscv64 with $CC set: it must be clang >= MIN_CLANG.
check_given_cc() {
  local -a words
  read -r -a words <<<"$CC"
  ((${#words[@]})) || die 2 "CC is set but empty"
  local major
  major=$(clang_major "${words[@]}")
  if [[ -z $major ]]; then
    die 2 "CC='$CC' is not clang (its --version names no 'clang version'); the riscv64 (K3) build of kernels/ime2 needs clang >= $MIN_CLANG: the IME2 path emits '.insn r' with vector registers, which GNU as rejects. Unset CC to let this script pick one, or install it: sudo apt-get install $APT_PACKAGE"
  fi
  if ((major < MIN_CLANG)); then
    die 2 "CC='$CC' is clang $major; the riscv64 (K3) build of kernels/ime2 needs clang >= $MIN_CLANG. Unset CC to let this script pick one, or install it: sudo apt-get install $APT_PACKAGE"
  fi
  printf '%s\n' "$CC"
}

# riscv64 without $CC: the newest clang >= MIN_CLANG on PATH.
search_path() {
  local best="" best_major=0 seen="" dir cand name major what
  local -a dirs
  IFS=: read -r -a dirs <<<"${PATH:-}"
  for dir in "${dirs[@]}"; do
    [[ -n $dir && -d $dir ]] || continue
    for cand in "$dir"/clang "$dir"/clang-[0-9]*; do
      name=${cand##*/}
      [[ $name =~ ^clang(-[0-9]+)?$ && -f $cand && -x $cand ]] || continue
      major=$(clang_major "$cand")
      if [[ -n $major ]]; then what="clang $major"; else what="not clang"; fi
      seen+="${seen:+, }$cand ($what)"
      if [[ -n $major ]] && ((major >= MIN_CLANG && major > best_major)); then
        best=$cand
        best_major=$major
      fi
    done
  done
  if [[ -z $best ]]; then
    die 1 "the riscv64 (K3) host build of kernels/ime2 needs clang >= $MIN_CLANG (the IME2 path emits '.insn r' with vector registers, which GNU as rejects; docs/boards.md), but no clang >= $MIN_CLANG is on PATH (found: ${seen:-no clang at all}). Install it: sudo apt-get install $APT_PACKAGE (Debian 12 and later, Ubuntu 24.04 and later), or set CC to a clang >= $MIN_CLANG"
  fi
  printf '%s\n' "$best"
}

main() {
  local arch=${NPU_IME2_HOST_ARCH:-}
  while (($#)); do
    case $1 in
      --arch) (($# >= 2)) || die 2 "--arch needs a value (e.g. riscv64, x86_64)"; arch=$2; shift 2 ;;
      --arch=*) arch=${1#--arch=}; shift ;;
      -h | --help) printf 'usage: %s [--arch ARCH]\n' "$ME"; exit 0 ;;
      *) die 2 "unknown argument '$1' (usage: $ME [--arch ARCH])" ;;
    esac
  done
  [[ -n $arch ]] || arch=$(uname -m)
  case $arch in
    riscv64)
      if [[ -n ${CC:-} ]]; then check_given_cc; else search_path; fi ;;
    *)
      printf '%s\n' "${CC:-cc}" ;;
  esac
}

main "$@"
