"""Run a command and report the machine's peak memory in use while it ran.

    python benchmarks/peak_memory.py [--every SECONDS] [--out FILE] -- COMMAND [ARGS...]

"In use" is ``MemTotal - MemAvailable`` from ``/proc/meminfo`` (the whole machine, so run
nothing else beside the command), sampled every ``--every`` seconds (default 2). At the end one
line goes to stderr and, with ``--out``, as JSON to FILE: the peak in GiB, the baseline before
the command started, the number of samples and the command's wall time. The exit status is the
command's. Linux only (reads /proc/meminfo). Used for the ``.ci/run`` figures in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

GIB = 1024 ** 3


def in_use_bytes() -> int:
    """``MemTotal - MemAvailable`` in bytes, from /proc/meminfo."""
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0]) * 1024
    return fields["MemTotal"] - fields["MemAvailable"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, default=2.0, help="sampling interval in seconds")
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd or args.every <= 0:
        parser.error("give a command after '--' and a positive --every")
    baseline = in_use_bytes()
    peak, samples = baseline, 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak, samples
        while not done.wait(args.every):
            peak, samples = max(peak, in_use_bytes()), samples + 1

    t = threading.Thread(target=sample, daemon=True)
    start = time.monotonic()
    t.start()
    code = subprocess.call(cmd)
    done.set()
    t.join()
    wall = time.monotonic() - start
    result = {"command": cmd, "peak_in_use_gib": round(peak / GIB, 2),
              "baseline_in_use_gib": round(baseline / GIB, 2), "samples": samples,
              "wall_s": round(wall, 1), "exit_status": code}
    print(f"peak_memory: peak {result['peak_in_use_gib']} GiB in use (baseline {result['baseline_in_use_gib']} GiB), "
          f"{samples} samples, {wall:.0f} s, exit {code}", file=sys.stderr)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
