# Sourced by tools/vllm-*-env/build.sh: what every vendor environment shares.
# (npu_conformance.vendor_envs counts this file in each environment's digest.)

# quiet CMD...: run CMD, dropping pip's noise about the machine's empty local index directories;
# keep its exit status.
quiet() {
  local rc; set +e
  "$@" 2>&1 | grep -vE "is ignored: it is neither a file nor a directory|^\s*$"
  rc=${PIPESTATUS[0]}; set -e; return "$rc"
}

# install_sim_hooks ENV ROOT: ROOT/simulators on a .pth of ENV, then the npusim.alias start-up hook
# (which sorts after it), so that NPU_HARNESS_TARGET=<dev>-sim makes `import rebel` / `import
# qbruntime` load the simulator. The project itself and its plugin entry points stay out.
install_sim_hooks() {
  local env=$1 root=$2 sp
  sp=$("$env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$root/simulators" > "$sp/00_npusim_path.pth"
  PYTHONPATH="$root/simulators" "$env/bin/python" -c 'from npusim.alias import pth_line; print(pth_line())' \
    > "$sp/npu_harness_alias.pth"
}
