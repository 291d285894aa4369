"""Conformance reports: ``report.json`` (machine-readable) and ``report.md`` (a scenario ×
target table with sim and hw columns side by side, then skip reasons, figures and failures).
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from npu_conformance import results as res
from npu_conformance import targets as tg
from npu_conformance.version import harness_version

SCHEMA_VERSION = 1
#: Where reports go when no directory is given (relative to the pytest rootdir or the cwd).
DEFAULT_REPORT_DIR = "conformance-report"
_CELL = {res.PASS: "pass", res.FAIL: "FAIL", res.DIFFERS: "differs", res.SKIPPED: "skip", res.UNSUPPORTED: "n/a"}


def build(
    results: Iterable[res.ScenarioResult], targets: list[str], started: float
) -> dict[str, Any]:
    """The report as a JSON-ready dict (schema :data:`SCHEMA_VERSION`)."""
    ordered = sorted(results, key=lambda r: (r.scenario, targets.index(r.target)
                                             if r.target in targets else len(targets)))
    counts = {s: sum(1 for r in ordered if r.status == s) for s in res.STATUSES}
    return {
        "schema": SCHEMA_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "started": _dt.datetime.fromtimestamp(started, _dt.timezone.utc).isoformat(timespec="seconds"),
        "harness": {"version": harness_version()},
        "machine": {"node": platform.node(), "machine": platform.machine(),
                    "python": platform.python_version()},
        "targets": [
            {"name": n, "kind": tg.TARGETS[n].kind, "device": tg.TARGETS[n].device,
             "runtime": tg.TARGETS[n].runtime, **tg.availability(n).__dict__}
            for n in targets
        ],
        "summary": counts,
        "results": [r.to_json() for r in ordered],
    }


def table_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the scenario × target status table."""
    names = [t["name"] for t in report["targets"]]
    cells: dict[str, dict[str, str]] = {}
    for r in report["results"]:
        cells.setdefault(r["scenario"], {})[r["target"]] = _CELL[r["status"]]
    rows = [[scenario] + [row.get(n, "") for n in names] for scenario, row in cells.items()]
    return ["scenario"] + names, rows


def format_text(report: dict[str, Any]) -> str:
    """A plain-text table for the terminal, then the per-target availability lines."""
    header, rows = table_rows(report)
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    line = lambda cols: "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()  # noqa: E731
    out = [line(header), line(["-" * w for w in widths])] + [line(r) for r in rows]
    out.append("")
    for t in report["targets"]:
        state = "available  " if t["available"] else "unavailable"
        out.append(f"{t['name']:<11} {state} {t['reason']}")
    s = report["summary"]
    out.append("")
    out.append(", ".join(f"{s[k]} {k}" for k in res.STATUSES))
    out.append(f"npu-harness {report.get('harness', {}).get('version', 'unknown')}")
    return "\n".join(out)


def format_markdown(report: dict[str, Any]) -> str:
    header, rows = table_rows(report)
    md = [f"# Conformance report ({report['created']})", ""]
    s = report["summary"]
    md.append(", ".join(f"{s[k]} {k}" for k in res.STATUSES) + ".")
    md += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(r) + " |" for r in rows]
    md += ["", "`n/a`: the scenario does not apply to that target's device. `differs`: a vendor plugin's "
           "column failed as a known, explained difference records (listed below).", "",
           "## Targets", "", "| target | kind | runtime | available | reason |", "|---|---|---|---|---|"]
    md += [f"| {t['name']} | {t['kind']} | {t['runtime']} | {'yes' if t['available'] else 'no'} "
           f"| {t['reason']} |" for t in report["targets"]]
    figured = [r for r in report["results"] if r["figures"]]
    if figured:
        md += ["", "## Figures", "", "| scenario | target | figures |", "|---|---|---|"]
        md += [f"| {r['scenario']} | {r['target']} | "
               + ", ".join(res.Figure(k, v["value"], v["unit"]).format() for k, v in r["figures"].items())
               + " |" for r in figured]
    differs = [r for r in report["results"] if r["status"] == res.DIFFERS]
    if differs:
        md += ["", "## Known differences", ""]
        md += [f"- `{r['scenario']}` on `{r['target']}`: {r['message']}" for r in differs]
    failed = [r for r in report["results"] if r["status"] == res.FAIL]
    if failed:
        md += ["", "## Failures", ""]
        md += [f"- `{r['scenario']}` on `{r['target']}`: {r['message']}" for r in failed]
    m = report["machine"]
    md += ["", f"Machine: {m['node']} ({m['machine']}, Python {m['python']}); "
               f"npu-harness {report.get('harness', {}).get('version', 'unknown')}."]
    return "\n".join(md) + "\n"


def write(out_dir: Path, *, results: Iterable[res.ScenarioResult], targets: list[str],
          started: float) -> dict[str, Any]:
    """Write ``report.json`` and ``report.md`` into ``out_dir`` (created if missing)."""
    report = build(results, targets, started)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out_dir / "report.md").write_text(format_markdown(report), encoding="utf-8")
    return report


def load(out_dir: Path) -> dict[str, Any]:
    """Read ``report.json`` back.

    Raises:
        FileNotFoundError: no report in ``out_dir``.
    """
    return json.loads((out_dir / "report.json").read_text(encoding="utf-8"))
