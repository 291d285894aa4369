"""``npusim`` needs numpy alone: it imports, and its tests pass (skipping the comparisons with
Hugging Face), in a Python where torch, transformers and vLLM cannot be imported.

The one documented exception is ``npusim.rbln``: it is the only simulator allowed to import torch,
because ``rebel`` (which it simulates) is a torch compiler. Its device model (``parts``,
``memory``, ``rblnfile``, ``errors``, ``compile_context``) stays stdlib/numpy-only, which
:func:`test_rbln_device_model_imports_without_torch` checks without running the package's
``__init__`` (the part that imports torch).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BLOCKED = ("torch", "transformers", "vllm", "safetensors")

# A meta-path finder that makes the blocked packages look uninstalled, installed before
# anything else is imported.
_PRELUDE = f"""
import importlib.abc, sys
class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {BLOCKED!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)", name=name)
        return None
sys.meta_path.insert(0, _Blocked())
"""
HERE = Path(__file__).resolve().parent


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _PRELUDE + code], capture_output=True,
                          text=True, timeout=600, cwd=HERE.parent.parent)


#: The simulator allowed to import torch (``rebel`` is a torch compiler), with its submodules.
TORCH_EXCEPTION = "npusim.rbln"


def test_npusim_imports_without_torch():
    """Every module of ``npusim`` except :data:`TORCH_EXCEPTION` and its submodules imports
    with torch blocked (the walk never imports the exception, not even to list its modules)."""
    proc = _run(
        "import pkgutil, importlib, npusim\n"
        f"SKIP = {TORCH_EXCEPTION!r}\n"
        "names, skipped = [], []\n"
        "def walk(path, prefix):\n"
        "    for m in pkgutil.iter_modules(path, prefix):\n"
        "        if m.name == SKIP or m.name.startswith(SKIP + '.'):\n"
        "            skipped.append(m.name)\n"
        "            continue\n"
        "        mod = importlib.import_module(m.name)\n"
        "        names.append(m.name)\n"
        "        if m.ispkg:\n"
        "            walk(mod.__path__, m.name + '.')\n"
        "walk(npusim.__path__, 'npusim.')\n"
        "heavy = sorted(m for m in sys.modules if m.partition('.')[0] in " + repr(BLOCKED) + ")\n"
        "print('IMPORTED', len(names), 'HEAVY', heavy, 'SKIPPED', skipped)\n"
        "print('NAMES', names)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout
    assert int(proc.stdout.split()[1]) >= 5
    assert f"SKIPPED [{TORCH_EXCEPTION!r}]" in proc.stdout
    names = proc.stdout.split("NAMES", 1)[1]
    assert "'npusim.mxq'" in names and "'npusim.llm'" in names and "'npusim.alias'" in names
    assert TORCH_EXCEPTION not in names


def test_rbln_device_model_imports_without_torch(tmp_path):
    """``npusim.rbln``'s stdlib-only device model works with torch blocked.

    ``npusim.rbln`` is the one simulator allowed to import torch (``rebel`` is a torch
    compiler), in its ``__init__``, compiler, runtime and ops; its device model (``parts``,
    ``memory``, ``rblnfile``, ``errors``, ``compile_context``) must stay stdlib/numpy-only. A bare
    package module pre-registered as ``npusim.rbln`` (``__path__`` = its directory) lets the
    submodules import without running that ``__init__``.
    """
    proc = _run(
        "import json, types, numpy as np\n"
        "from pathlib import Path\n"
        "import npusim\n"
        "pkg = types.ModuleType('npusim.rbln')\n"
        "pkg.__path__ = [str(Path(npusim.__path__[0]) / 'rbln')]\n"
        "pkg.__package__ = 'npusim.rbln'\n"
        "sys.modules['npusim.rbln'] = pkg\n"
        "from npusim.rbln import compile_context, errors, memory, parts, rblnfile\n"
        "# parts: the inventory from the environment\n"
        "s = parts.settings({})\n"
        "assert s.devices == ('RBLN-CA25',), s\n"
        "p = s.part(0)\n"
        "assert (p.family, p.chiplets, p.usable_per_chiplet) == ('atom', 1, 16 * 2**30 - 288 * 2**20), p\n"
        "s = parts.settings({'NPUSIM_RBLN': json.dumps({'devices': ['RBLN-CR03', 'rbln-ca22']})})\n"
        "assert s.devices == ('RBLN-CR03', 'RBLN-CA22') and s.part(0).chiplets == 4 and s.part(2) is None\n"
        "assert parts.settings({'RBLN_FORCE_NPU_NAME': 'RBLN-CR13'}).devices == ('RBLN-CR13',)\n"
        "try:\n"
        "    parts.part_for('GPU-0')\n"
        "except errors.RBLNDeviceError as exc:\n"
        "    assert 'unknown NPU name' in str(exc) and isinstance(exc, RuntimeError)\n"
        "else:\n"
        "    raise AssertionError('GPU-0 accepted')\n"
        "# memory: the split and the DRAM ledger\n"
        "assert memory.split(10, 2, 2) == [[3, 3], [2, 2]]\n"
        "assert sum(map(sum, memory.split(2**30 + 7, 1, 4))) == 2**30 + 7\n"
        "assert memory.align(1) == 2 * 2**20 and memory.align(0) == 0\n"
        "mem = memory.DeviceMemory(0, parts.part_for('RBLN-CA25', dram_per_chiplet=8 * 2**20))\n"
        "mem.allocate('w', [3 * 2**20])\n"
        "try:\n"
        "    mem.allocate('kv', [3 * 2**20])\n"
        "except errors.RBLNOutOfMemoryError as exc:\n"
        "    assert 'chiplet 0: cannot allocate' in str(exc), exc\n"
        "else:\n"
        "    raise AssertionError('allocation past the DRAM succeeded')\n"
        "mem.free('w'); mem.allocate('kv', [3 * 2**20])\n"
        "# rblnfile: a round trip and a corrupt file\n"
        "h = rblnfile.Header('npusim.rbln test', 'RBLN-CA25', 1, [('input_ids', [1, 128], 'int64')],\n"
        "                    [([1, 1, 1024], 'float32')], 'ctx', ['past_key_values_0'], {'past_key_values_0': 2}, 10, 20)\n"
        f"path = Path({str(tmp_path)!r}) / 'prefill.rbln'\n"
        "rblnfile.write(path, h, b'program bytes')\n"
        "h2, prog = rblnfile.read(path)\n"
        "assert h2 == h and prog == b'program bytes', (h2, prog)\n"
        "data = bytearray(path.read_bytes()); data[len(data) // 2] ^= 0xFF; path.write_bytes(bytes(data))\n"
        "try:\n"
        "    rblnfile.read(path)\n"
        "except errors.RBLNFileError as exc:\n"
        "    assert 'checksum mismatch' in str(exc), exc\n"
        "else:\n"
        "    raise AssertionError('a corrupt file was read')\n"
        "path.write_bytes(b'not a program')\n"
        "try:\n"
        "    rblnfile.read(path)\n"
        "except errors.RBLNFileError as exc:\n"
        "    assert 'bad magic' in str(exc), exc\n"
        "else:\n"
        "    raise AssertionError('a file without the magic was read')\n"
        "# compile_context: static buffers of any array with a shape and a dtype\n"
        "ctx = compile_context.CompileContext(use_weight_sharing=True)\n"
        "ctx.mark_static_address(np.zeros((2, 2, 16, 32), np.float32), 'past_key_values_0')\n"
        "assert ctx.static['past_key_values_0'] == compile_context.StaticBuffer('past_key_values_0', (2, 2, 16, 32), 'float32')\n"
        "heavy = sorted(m for m in sys.modules if m.partition('.')[0] in " + repr(BLOCKED) + ")\n"
        "rbln = sorted(m for m in sys.modules if m.startswith('npusim.rbln.'))\n"
        "print('HEAVY', heavy, 'RBLN', rbln)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout, proc.stdout
    assert ("RBLN ['npusim.rbln.compile_context', 'npusim.rbln.errors', 'npusim.rbln.memory', "
            "'npusim.rbln.parts', 'npusim.rbln.rblnfile']") in proc.stdout, proc.stdout


def test_npusim_tests_pass_without_torch(tmp_path):
    """Every ``tests/npusim`` test passes with torch blocked, or skips naming the import; the
    modules of :data:`numpy_only_modules.NUMPY_ONLY_MODULES` (which a whole run runs here only)
    ran without a single skip."""
    import xml.etree.ElementTree as ET

    from numpy_only_modules import NUMPY_ONLY_MODULES

    xml = tmp_path / "child.xml"
    proc = _run(
        "import pytest\n"
        f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-p', 'no:randomly', "
        f"'{HERE}', '--ignore', '{Path(__file__).resolve()}', '-rs', '--junitxml', '{xml}']))\n"
    )
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert "passed" in proc.stdout and "could not import 'torch'" in proc.stdout, tail
    ran: dict[str, int] = {}
    skipped: dict[str, int] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        mod = case.get("classname", "").rsplit(".", 1)[-1]
        ran[mod] = ran.get(mod, 0) + 1
        if any(child.tag == "skipped" for child in case):
            skipped[mod] = skipped.get(mod, 0) + 1
    assert not NUMPY_ONLY_MODULES - set(ran), f"not run here: {sorted(NUMPY_ONLY_MODULES - set(ran))}"
    assert not {m: n for m, n in skipped.items() if m in NUMPY_ONLY_MODULES}, skipped


def test_npusim_mxq_runs_without_torch(tmp_path):
    proc = _run(
        "import json, numpy as np\n"
        "from pathlib import Path\n"
        "import npusim.mxq as qb\n"
        "from npusim.llm import ModelConfig, save_safetensors\n"
        "from npusim.mxq.compile import compile_artifact\n"
        "from npusim.tinymodel import make_config, make_weights\n"
        f"d = Path({str(tmp_path)!r})\n"
        "cfg = make_config('qwen3', vocab_size=64, num_hidden_layers=1, max_position_embeddings=32)\n"
        "(d / 'config.json').write_text(json.dumps(cfg))\n"
        "save_safetensors(d / 'model.safetensors', make_weights(ModelConfig.from_dict(cfg)))\n"
        "art = compile_artifact(d, d / 'art', max_width=8, prefill_chunk_size=8)\n"
        "m = qb.Model(str(art / 'model.mxq')); m.launch(qb.Accelerator())\n"
        "[out] = m.infer([np.ones((1, 1, 3, 128), np.float32)], None, 0)\n"
        "heavy = sorted(m for m in sys.modules if m.partition('.')[0] in " + repr(BLOCKED) + ")\n"
        "print('SHAPE', out.shape, 'HEAVY', heavy)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert "SHAPE (1, 1, 1, 64) HEAVY []" in proc.stdout
