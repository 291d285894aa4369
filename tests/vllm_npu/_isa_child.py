"""Child process of ``test_isa_matrix.py``, run under ``qemu-x86_64-static -cpu MODEL``.

``python _isa_child.py INPUTS.npz OUT.npy`` with ``NPU_HARNESS_TARGET=mblt-sim``:

1. a forked child runs ``import vllm._C`` (what the inherited ``Platform.import_kernels`` did)
   and its exit status is recorded: the proof that this CPU model lacks what that build needs;
2. ``import vllm._custom_ops`` loads vLLM's kernels exactly as start-up does (it calls
   ``current_platform.import_kernels()`` on the platform vLLM resolved);
3. every device platform the plugins register is imported as vLLM imports it and its
   ``import_kernels`` called (a platform that is not built reports its NotImplementedError);
4. ``/proc/self/maps`` tells which vLLM kernel library is mapped after each step;
5. one ``ime2_hp_gemm_cpu`` call through the ``auto`` path on the inputs; C goes to OUT.npy.

Prints one line ``ISA_RESULT <json>``.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

import numpy as np
import torch  # noqa: F401 - loaded before the fork, as vLLM's own import does

ENV = "NPU_HARNESS_TARGET"


def raw_vllm_c_status() -> dict:
    pid = os.fork()
    if pid == 0:  # the child: what Platform.import_kernels does
        try:
            import vllm._C  # noqa: F401
        except BaseException:  # noqa: BLE001
            os._exit(3)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return {"signal": os.WTERMSIG(status)}
    return {"exit": os.WEXITSTATUS(status)}


def main(inputs: str, out: str) -> None:
    result: dict = {"raw_vllm_C": raw_vllm_c_status()}

    import vllm._custom_ops  # noqa: F401 - start-up: current_platform.import_kernels()
    from vllm.platforms import current_platform

    from npu_conformance.host import host_lines
    from vllm_npu import cpu_kernels

    result["startup_platform"] = type(current_platform).__qualname__
    result["after_startup"] = cpu_kernels.loaded_vllm_kernels()

    platforms = {}
    target = os.environ.get(ENV)
    for device in ("mblt", "rbln", "neuron"):
        os.environ[ENV] = f"{device}-sim"
        qualname = importlib.import_module(f"vllm_npu.{device}").register()
        module, _, cls_name = qualname.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), cls_name)
        except NotImplementedError as exc:
            platforms[device] = {"built": False, "reason": str(exc)}
            continue
        cls.import_kernels()
        platforms[device] = {"built": True, "qualname": qualname, "loaded": cpu_kernels.loaded_vllm_kernels()}
    os.environ[ENV] = target or ""
    result["platforms"] = platforms

    isa = cpu_kernels.host_isa()
    result["isa_level"] = isa.level
    result["vllm_kernel_build"] = cpu_kernels.vllm_kernel_build(isa)
    result["host_lines"] = dict(host_lines())

    from vllm_npu.ime2 import kernel

    data = np.load(inputs)
    c = kernel.ime2_hp_gemm_cpu(data["a"], data["qweight"], data["scales"])
    np.save(out, np.asarray(c, dtype=np.float32))
    result["ime2"] = {"auto_path": kernel.auto_path(), "x86_variant": kernel.x86_variant()}
    print("ISA_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
