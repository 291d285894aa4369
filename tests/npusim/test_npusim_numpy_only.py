"""``npusim`` needs numpy alone: it imports, and its tests pass (skipping the comparisons with
Hugging Face), in a Python where torch, transformers and vLLM cannot be imported."""

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


def test_npusim_imports_without_torch():
    proc = _run(
        "import pkgutil, importlib, npusim\n"
        "names = [m.name for m in pkgutil.walk_packages(npusim.__path__, 'npusim.')]\n"
        "for n in names: importlib.import_module(n)\n"
        "heavy = sorted(m for m in sys.modules if m.partition('.')[0] in " + repr(BLOCKED) + ")\n"
        "print('IMPORTED', len(names), 'HEAVY', heavy)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout
    assert int(proc.stdout.split()[1]) >= 5


def test_npusim_tests_pass_without_torch():
    proc = _run(
        "import pytest\n"
        f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-p', 'no:randomly', "
        f"'{HERE}', '--ignore', '{Path(__file__).resolve()}', '-rs']))\n"
    )
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert "passed" in proc.stdout and "could not import 'torch'" in proc.stdout, tail


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
