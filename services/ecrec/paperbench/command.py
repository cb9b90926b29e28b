"""`ecrec bench paper`: run the plan (or reuse its jobs, or only re-render), then write results.json, the
figures and report.md into OUT."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

from ecrec.paperbench.experiments import PaperBench
from ecrec.paperbench.figures import write_figures
from ecrec.paperbench.plan import FULL, QUICK
from ecrec.paperbench.report import write_report


def bench_paper(
    out: Path,
    quick: bool = False,
    work: Path | None = None,
    render_only: bool = False,
    only_cached: bool = False,
    log=print,
) -> dict:
    """Run the plan, write results.json, the figures and report.md into `out`; return the results.
    `render_only`: no jobs, the figures and report again from OUT/results.json. `only_cached`: no jobs either,
    the results of the jobs in WORK/runs.json (a reduced run: the report lists what is missing)."""
    plan = QUICK if quick else FULL
    out.mkdir(parents=True, exist_ok=True)
    if render_only:
        results = json.loads((out / "results.json").read_text())
        quick = results["plan"]["name"] == "quick"
    else:
        tmp = None
        if work is None:
            tmp = tempfile.TemporaryDirectory(prefix="ecrec-bench-paper-")
            work = Path(tmp.name)
        work.mkdir(parents=True, exist_ok=True)
        try:
            log(f"# ecrec bench paper ({plan.name}): jobs under {work}")
            results = _finite(PaperBench(plan, work, log, only_cached).run_all())
        finally:
            if tmp is not None:
                tmp.cleanup()
        results["command"] = (
            "ecrec bench paper"
            + (" --quick" if quick else "")
            + f" --out {out}"
            + (f" --work {work}" if not tmp else "")
            + (" --only-cached" if only_cached else "")
        )
        (out / "results.json").write_text(json.dumps(results, indent=1))
    figures = write_figures(results, out)
    write_report(results, out, figures, results.get("command", "ecrec bench paper"))
    log(f"wrote {out / 'report.md'}, {out / 'results.json'} and {len(figures)} figures")
    return results


def _finite(o):
    """NaN (a window with no sample) as null: results.json stays valid JSON."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_finite(v) for v in o]
    return o
