"""The vLLM starts of a run, read from the ``start_profile`` records, and the start budget.

Every vLLM process writes ``<dir>/<pid>.jsonl`` when ``NPU_HARNESS_START_PROFILE`` names a
directory (:mod:`vllm_npu.start_profile`, a vLLM general plugin). :func:`starts_of` joins a
``vllm serve`` API server with the engine core it started, and finds the engines of
``vllm.LLM`` and ``vllm bench`` runs and the ``vllm serve`` runs refused before an engine
existed. ``benchmarks/suite_profile.py`` prints them; the pytest plugin counts a run's starts per
test module against :data:`BUDGET_FILE` (:func:`check_budget`).

The budget: :data:`BUDGET_FILE` (``tests/start_budget.json``) holds the measured starts of each
test module of a whole run (refresh it with ``python -m npu_conformance.starts STARTS_DIR`` from
a whole run made with ``NPU_HARNESS_START_PROFILE=STARTS_DIR``). A run fails when its modules
start more than their budgets by more than :data:`MARGIN` in all (a module missing from the file
has a budget of 0): a change that adds a start must say so by updating the file.

Standard library only; nothing here imports vLLM.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

#: The variable naming the directory the vLLM processes write their records to, and the one
#: naming what started them (the same names as :mod:`vllm_npu.start_profile`'s, which writes them).
ENV_DIR = "NPU_HARNESS_START_PROFILE"
ENV_LABEL = "NPU_HARNESS_START_LABEL"
#: Starts per test module of a whole run, relative to the run's root directory.
BUDGET_FILE = Path("tests") / "start_budget.json"
#: How many starts a run may make beyond its modules' budgets, in all, before it fails.
MARGIN = 2


@dataclass
class Proc:
    """One vLLM process's ``process`` record and its milestones (epoch seconds)."""

    pid: int
    ppid: int
    argv: list[str]
    created: float | None
    loaded: float
    target: str
    test: str
    label: str
    #: (name, time, message, test, label) of each milestone.
    milestones: list[tuple[str, float, str, str, str]] = field(default_factory=list)
    #: CPU seconds (user + system) and end time from its ``exit`` record; None when it was killed.
    cpu_s: float | None = None
    ended: float | None = None

    def first(self, name: str) -> float | None:
        return next((m[1] for m in self.milestones if m[0] == name), None)

    @property
    def is_serve(self) -> bool:
        """A ``vllm serve`` process (an API server, or the engine core it spawned, which takes
        its argv)."""
        return len(self.argv) >= 2 and self.argv[1] == "serve"


@dataclass(frozen=True)
class Start:
    """One start: what started it and its phases in seconds (None: not seen).

    ``kind``: ``serve`` (a ``vllm serve`` API server and its engine core), ``engine`` (a
    ``vllm.LLM``, ``vllm bench throughput``... engine), ``refused`` (a ``vllm serve`` that exited
    before it started an engine core). Phases: ``front`` (the API server's process start to its
    parsed arguments: the interpreter and ``import vllm``), ``spawn`` (the engine core's process
    start to its first log line), ``engine`` (engine init to ready: model load, KV cache,
    warm-up), ``serve`` (engine ready to the API server listening), ``total``.
    """

    kind: str
    who: str
    target: str
    args: str
    front_s: float | None
    spawn_s: float | None
    engine_s: float | None
    serve_s: float | None
    total_s: float | None
    ok: bool

    @property
    def module(self) -> str:
        """The test module that started it (``tests/test_cli.py``), or what :attr:`who` is."""
        return self.who.split("::", 1)[0]


def load_procs(starts_dir: Path) -> dict[int, Proc]:
    """Every process record under ``starts_dir`` (``<pid>.jsonl`` files), by pid."""
    procs: dict[int, Proc] = {}
    pending: list[dict] = []
    for path in sorted(Path(starts_dir).glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("kind") == "process":
                procs[rec["pid"]] = Proc(rec["pid"], rec["ppid"], list(rec.get("argv", [])), rec.get("created"),
                                         rec["loaded"], rec.get("target", ""), rec.get("test", ""),
                                         rec.get("label", ""))
            elif rec.get("kind") in ("milestone", "exit"):
                pending.append(rec)
    for rec in pending:
        proc = procs.get(rec["pid"])
        if proc is None:
            continue
        if rec["kind"] == "exit":
            proc.cpu_s, proc.ended = rec.get("cpu_s"), rec.get("t")
        else:
            proc.milestones.append((rec["name"], rec["t"], rec.get("message", ""), rec.get("test", ""),
                                    rec.get("label", "")))
    for proc in procs.values():
        proc.milestones.sort(key=lambda m: m[1])
    return procs


def test_name(test: str) -> str:
    """``PYTEST_CURRENT_TEST`` without its phase suffix (`` (call)``, `` (setup)``)."""
    return re.sub(r" \((setup|call|teardown)\)$", "", test)


def args_of(argv: list[str]) -> str:
    """A short form of a vLLM command line: ``serve <model dir name> <args>`` without the host
    and port, or the first words of another command."""
    if len(argv) >= 3 and argv[1] == "serve":
        out, skip = [], False
        for a in argv[3:]:
            if skip:
                skip = False
            elif a in ("--host", "--port"):
                skip = True
            else:
                out.append(a)
        return f"serve {Path(argv[2]).name} {' '.join(out)}".strip()
    return " ".join(Path(a).name if a.startswith("/") else a for a in argv[:6])


def _who(*candidates: tuple[str, str]) -> str:
    """The first (label, test) pair that names something."""
    for label, test in candidates:
        if label or test:
            return label or test_name(test)
    return "(outside pytest)"


def starts_of(procs: dict[int, Proc]) -> list[Start]:
    """The starts in ``procs`` (see :class:`Start`): one per ``engine_init`` milestone (an
    engine core began), joined with the ``vllm serve`` API server that started it, plus one per
    ``vllm serve`` API server that never started an engine."""
    out: list[Start] = []
    for proc in procs.values():
        inits = [m for m in proc.milestones if m[0] == "engine_init"]
        readies = [m[1] for m in proc.milestones if m[0] == "engine_ready"]
        for i, (_, t_init, _, m_test, m_label) in enumerate(inits):
            t_next = inits[i + 1][1] if i + 1 < len(inits) else float("inf")
            t_ready = next((t for t in readies if t_init <= t < t_next), None)
            engine = None if t_ready is None else t_ready - t_init
            parent = procs.get(proc.ppid)
            if parent is not None and parent.is_serve and i == 0:
                t_args, t_listen = parent.first("args"), parent.first("server_ready")
                front = None if parent.created is None or t_args is None else t_args - parent.created
                spawn = None if proc.created is None else t_init - proc.created
                serve = None if t_listen is None or t_ready is None else t_listen - t_ready
                total = None if parent.created is None or t_listen is None else t_listen - parent.created
                out.append(Start("serve", _who((parent.label, parent.test)), parent.target or "cpu",
                                 args_of(parent.argv), front, spawn, engine, serve, total, t_listen is not None))
                continue
            spawn = t_init - proc.created if i == 0 and proc.created is not None else None
            total = None if spawn is None or engine is None else spawn + engine
            out.append(Start("engine", _who((m_label, m_test), (proc.label, proc.test)), proc.target or "cpu",
                             args_of(proc.argv), None, spawn, engine, None, total, t_ready is not None))
    # A vllm serve API server none of whose children began an engine: refused before spawning
    # one (it paid the imports, not an engine), or its engine core died before its first line.
    for proc in procs.values():
        parent = procs.get(proc.ppid)
        if not proc.is_serve or (parent is not None and parent.is_serve):
            continue
        children = [c for c in procs.values() if c.ppid == proc.pid]
        if any(m[0] == "engine_init" for c in children for m in c.milestones):
            continue
        last = max([m[1] for m in proc.milestones] + [proc.loaded])
        front = None if proc.created is None else last - proc.created
        who = _who((proc.label, proc.test))
        if children:
            child = children[0]
            spawn = None if child.created is None else max(child.loaded, last) - child.created
            out.append(Start("serve", who, proc.target or "cpu", args_of(proc.argv), front, spawn, None, None,
                             None, False))
        else:
            out.append(Start("refused", who, proc.target or "cpu", args_of(proc.argv), front, None, None, None,
                             front, False))
    return out


def per_module(starts: list[Start]) -> Counter:
    """Starts per test module (:attr:`Start.module`)."""
    return Counter(s.module for s in starts)


def read_budget(path: Path) -> dict[str, int] | None:
    """The starts per module in ``path``; None when the file is missing.

    Raises:
        ValueError: the file is not a JSON object of whole numbers (the message names it).
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    if not isinstance(data, dict) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                             for v in data.values()):
        raise ValueError(f"{path}: expected a JSON object of module -> whole number of starts")
    return {str(k): int(v) for k, v in data.items()}


def check_budget(counts: Counter, budget: dict[str, int], margin: int = MARGIN) -> str | None:
    """None when ``counts`` (starts per module) exceed ``budget`` by at most ``margin`` in all;
    else the message that fails the run, naming each module over its budget."""
    over = {m: n - budget.get(m, 0) for m, n in counts.items() if n > budget.get(m, 0)}
    if sum(over.values()) <= margin:
        return None
    rows = ", ".join(f"{m}: {counts[m]} (budget {budget.get(m, 0)})" for m in sorted(over))
    return (f"this run started vLLM {sum(over.values())} times more than {BUDGET_FILE} allows "
            f"(margin {margin}): {rows}. A change that adds starts says so: share a server, or "
            f"refresh the budget (python -m npu_conformance.starts STARTS_DIR, see its docstring)")


def main(argv: list[str]) -> int:
    """``python -m npu_conformance.starts STARTS_DIR [OUT]``: write the starts per module of a
    whole run (made with ``NPU_HARNESS_START_PROFILE=STARTS_DIR``) to OUT (default
    :data:`BUDGET_FILE`)."""
    if len(argv) not in (1, 2):
        print(main.__doc__, file=sys.stderr)
        return 2
    counts = per_module(starts_of(load_procs(Path(argv[0]))))
    if not counts:
        print(f"{argv[0]}: no vLLM start recorded", file=sys.stderr)
        return 1
    out = Path(argv[1]) if len(argv) == 2 else BUDGET_FILE
    out.write_text(json.dumps(dict(sorted(counts.items())), indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out}: {sum(counts.values())} starts in {len(counts)} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
