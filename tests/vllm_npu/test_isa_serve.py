"""End to end on an emulated CPU without AVX-512: ``NPU_HARNESS_TARGET=mblt-sim vllm serve``
with the API server and the engine core both under ``qemu-x86_64-static -cpu Haswell``
(``_qemu_x86.emulated_python``), greedy completions equal to the golden decoder.

This is the bug of a fresh clone on an AVX2-only machine (every MBLT server exited -4 right
after start): both processes must map ``vllm/_C_AVX2`` and no other vLLM kernel build, and
serve. Start-up takes about 3 minutes under QEMU here (about 20 s natively), so the module
starts one server and the prefix-cache calibration is off.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")
from _qemu_x86 import unavailable_reason  # noqa: E402
from _qemu_x86 import emulated_python  # noqa: E402

from npu_conformance import vllm_server  # noqa: E402
from npusim import tinymodel  # noqa: E402
from npusim.llm import Decoder  # noqa: E402
from npusim.mxq.compile import compile_artifact  # noqa: E402
from vllm_npu.cpu_kernels import loaded_vllm_kernels  # noqa: E402

if unavailable_reason():
    pytest.skip(unavailable_reason(), allow_module_level=True)

pytestmark = pytest.mark.slow

CPU = "Haswell"
START_TIMEOUT_S = 1800.0
N_NEW = 8


def _emulated_pids(script: Path) -> list[int]:
    """PIDs of the QEMU processes running ``script``'s interpreter (the server and its children)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"qemu-x86_64-static") and str(script).encode() in argv:
            found.append(int(proc.name))
    return found


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("isa-serve")
    hf = tinymodel.build("llama", root / "hf")
    art = compile_artifact(hf, root / "art", max_batch_size=4, prefill_chunk_size=64)
    python = emulated_python(root / "venv", CPU)
    env = vllm_server.vllm_env("mblt-sim", VLLM_MBLT_PREFIX_CACHE_CALIBRATE="0")
    server = vllm_server.start(art, ["--max-model-len", "512"], env=env, log=root / "serve.log",
                               timeout_s=START_TIMEOUT_S,
                               command=[str(python), "-m", "vllm.entrypoints.cli.main"])
    try:
        yield server, python, Decoder.from_pretrained(hf)
    finally:
        server.stop()


def test_both_processes_map_only_the_avx2_kernel_build(served):
    server, python, _ = served
    pids = _emulated_pids(python)
    assert len(pids) >= 2, f"expected the API server and the engine core under QEMU, found {pids}"
    loaded = {pid: set(loaded_vllm_kernels(Path(f"/proc/{pid}/maps"))) for pid in pids}
    with_kernels = [pid for pid, mods in loaded.items() if mods]
    assert len(with_kernels) >= 2, loaded  # the API server and the engine core (not the resource tracker)
    for pid in with_kernels:
        assert loaded[pid] == {"vllm._C_AVX2"}, (pid, loaded)


def test_greedy_equals_the_golden_decoder(served):
    server, _, golden = served
    rng = np.random.default_rng(5)
    for prompt in (rng.integers(10, 1000, size=30).tolist() for _ in range(2)):
        ids = vllm_server.completion_ids(server.complete(prompt, N_NEW, return_token_ids=True, ignore_eos=True))
        assert ids == [int(t) for t in golden.generate_greedy(prompt, N_NEW)]
    assert "Illegal instruction" not in server.log_text()
