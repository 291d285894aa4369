"""``benchmarks/npu_serving.py --device mblt`` (kept under its issue-4 name; see that script)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from npu_serving import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["--device", "mblt", *sys.argv[1:]]))
