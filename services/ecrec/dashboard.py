"""The Grafana dashboard of an ECRec job, generated from the panel list below.

`ecrec dashboard` prints it; `make dashboard` writes charts/ecrec/dashboards/ecrec.json, which the Helm chart
ships in a Grafana ConfigMap (tests/test_dashboard.py fails while the committed file is stale, or while a
query names a metric that no ecrec process exports). Every job panel reads the coordinator's own series
(`role="coordinator"`), so a Prometheus that scrapes only the coordinator shows every panel; `$namespace` and
`$ecrec_job` select the job (two jobs of one name in two namespaces stay apart) and `$datasource` the
Prometheus. `namespace` is the target label the Prometheus Operator gives every series it scrapes through a
PodMonitor or ServiceMonitor (the chart's); where there is none (a local run: tests/prom.py), the variable is
empty and `namespace=""` selects the series without the label. The operator panels (`OPERATOR_PANELS`) read
the operator's own `ecrec_operator_*` series, which belong to no job: they are summed by the operator's
namespace, whatever job is selected.

`render_png` draws the job panels from a real Prometheus (its `query_range` API evaluates the same PromQL
Grafana would send) with matplotlib, laid out on Grafana's grid: docs/images/dashboard.png is one.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ecrec.metrics import JOB_PHASES, RECOVERY_PHASES, SHARD_STATES

UID = "ecrec-job"
JOB = '{namespace="$namespace", ecrec_job="$ecrec_job", role="coordinator"}'  # what every job query selects
RATE = "$__rate_interval"

# Grafana's colors for state timelines, by state (value mappings).
COLORS = {
    "pending": "#8e8e8e",
    "up": "#73bf69",
    "recovering": "#ff9830",
    "failed": "#f2495c",
    "none": "#8e8e8e",
    "detected": "#f2495c",
    "waiting": "#fade2a",
    "running": "#ff9830",
    "completed": "#73bf69",
    "interrupted": "#b877d9",
    "Pending": "#8e8e8e",
    "Running": "#73bf69",
    "Degraded": "#f2495c",
    "Recovering": "#ff9830",
    "Succeeded": "#5794f2",
    "Failed": "#c4162a",
}


def sel(metric: str, **labels: str) -> str:
    """`metric{namespace="$namespace", ecrec_job="$ecrec_job", role="coordinator", k="v"...}`."""
    extra = "".join(f', {k}="{v}"' for k, v in labels.items())
    return f"{metric}{JOB[:-1]}{extra}}}"


def state_code(metric: str, label: str, values: tuple[str, ...], by: str = "", first: int = 0) -> str:
    """One number per series from a one-hot state gauge: the index (from `first`) of the value that is 1, for
    a state timeline with value mappings. `by`: the label that names a series (e.g. shard)."""
    group = f" by ({by})" if by else ""
    terms = []
    for i, value in enumerate(values, start=first):
        if i == 0:
            continue  # contributes nothing: a series whose other values are all 0 reads as this one
        term = f"sum{group} ({sel(metric, **{label: value})})"
        terms.append(term if i == 1 else f"{i} * {term}")
    return " + ".join(terms)


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    kind: str  # timeseries | state-timeline | stat
    targets: tuple[Target, ...]
    grid: tuple[int, int, int, int]  # x, y, w, h on Grafana's 24-column grid
    unit: str = "short"
    states: tuple[str, ...] = ()  # state-timeline: the name of value 0, 1, ...
    description: str = ""
    extra: dict = field(default_factory=dict)


def _t(expr: str, legend: str) -> Target:
    return Target(expr, legend)


PANELS: tuple[Panel, ...] = (
    Panel(
        "Job phase",
        "state-timeline",
        (_t(state_code("ecrec_job_phase", "phase", JOB_PHASES), "phase"),),
        (0, 0, 24, 4),
        states=JOB_PHASES,
        description="Pending until every process registered; Degraded while a shard is failed; Recovering "
        "while a replacement is rebuilt.",
    ),
    Panel(
        "Throughput",
        "timeseries",
        (
            _t(f"sum(rate({sel('ecrec_samples_trained_total')}[{RATE}]))", "samples/s"),
            _t(sel("ecrec_training_throughput_samples_per_second"), "samples/s (2 s window)"),
        ),
        (0, 4, 12, 8),
        unit="short",
        description="Training samples per second, all workers.",
    ),
    Panel(
        "Step",
        "timeseries",
        (
            _t(sel("ecrec_training_step"), "step (slowest worker)"),
            _t(sel("ecrec_training_target_steps"), "target"),
        ),
        (12, 4, 12, 8),
        description="Steps every worker has completed, and the steps each trains.",
    ),
    Panel(
        "Loss",
        "timeseries",
        (_t(sel("ecrec_training_loss"), "rank {{rank}}"),),
        (0, 12, 12, 8),
        description="Latest training loss each worker reported (binary cross-entropy).",
    ),
    Panel(
        "Shard states",
        "state-timeline",
        (_t(state_code("ecrec_shard_state", "state", SHARD_STATES, by="shard"), "shard {{shard}}"),),
        (12, 12, 12, 8),
        states=SHARD_STATES,
        description="Each parameter server shard: up, failed (served degraded from parity), recovering "
        "(a replacement is being rebuilt).",
    ),
    Panel(
        "Recovery phase",
        "state-timeline",
        (
            _t(
                state_code("ecrec_recovery_phase", "phase", RECOVERY_PHASES, by="shard", first=1),
                "shard {{shard}}",
            ),
        ),
        (0, 20, 12, 8),
        states=("none", *RECOVERY_PHASES),
        description="Phase of each shard's latest recovery: detected, waiting (for a replacement), running "
        "(rebuilding lock groups), completed.",
    ),
    Panel(
        "Recovery progress",
        "timeseries",
        (
            _t(
                f"{sel('ecrec_recovery_lock_groups_done')} / ({sel('ecrec_recovery_lock_groups')} > 0)",
                "shard {{shard}} lock groups",
            ),
        ),
        (12, 20, 12, 8),
        unit="percentunit",
        description="Lock groups (data and parity) rebuilt, of the recovery plan's.",
    ),
    Panel(
        "Rows rebuilt",
        "timeseries",
        (_t(sel("ecrec_recovery_rows_rebuilt"), "shard {{shard}}"),),
        (0, 28, 12, 8),
        description="Data rows the latest recovery of each shard has rebuilt.",
    ),
    Panel(
        "Degraded traffic",
        "timeseries",
        (
            _t(f"sum(rate({sel('ecrec_degraded_reads_total')}[{RATE}]))", "degraded reads"),
            _t(f"sum(rate({sel('ecrec_degraded_writes_total')}[{RATE}]))", "degraded writes"),
        ),
        (12, 28, 12, 8),
        unit="rows/s",
        description="Rows of failed shards read by decoding their stripe, and updated at their acting home "
        "(rows per second, all workers).",
    ),
    Panel(
        "RPC latency p99",
        "timeseries",
        (
            _t(
                f"histogram_quantile(0.99, sum by (le, method) "
                f"(rate({sel('ecrec_job_rpc_latency_seconds_bucket')}[{RATE}])))",
                "{{method}}",
            ),
        ),
        (0, 36, 12, 8),
        unit="s",
        description="99th percentile latency of the workers' RPCs to the parameter servers, by method.",
    ),
    Panel(
        "RPC latency p50",
        "timeseries",
        (
            _t(
                f"histogram_quantile(0.5, sum by (le, method) "
                f"(rate({sel('ecrec_job_rpc_latency_seconds_bucket')}[{RATE}])))",
                "{{method}}",
            ),
        ),
        (12, 36, 12, 8),
        unit="s",
        description="Median latency of the workers' RPCs to the parameter servers, by method.",
    ),
    Panel(
        "Time to continue and to recover",
        "timeseries",
        (
            _t(
                f"{sel('ecrec_time_to_continue_seconds_sum')} / {sel('ecrec_time_to_continue_seconds_count')}",
                "time to continue (mean)",
            ),
            _t(
                f"{sel('ecrec_time_to_recover_seconds_sum')} / {sel('ecrec_time_to_recover_seconds_count')}",
                "time to recover (mean)",
            ),
        ),
        (0, 44, 12, 8),
        unit="s",
        description="From a kill (or its detection) to the first step completed after it, and to the "
        "replacement fully rebuilt; mean over the job's failures so far.",
    ),
    Panel(
        "Failures and recoveries",
        "timeseries",
        (
            _t(sel("ecrec_failures_detected_total"), "failures detected"),
            _t(sel("ecrec_recoveries_completed_total"), "recoveries completed"),
        ),
        (12, 44, 12, 8),
        description="Server failures detected and recoveries completed since the coordinator started.",
    ),
    Panel(
        "Parity check",
        "stat",
        (
            _t(sel("ecrec_parity_check_stripes_total", result="ok"), "stripes ok"),
            _t(sel("ecrec_parity_check_stripes_total", result="mismatch"), "stripes mismatched"),
        ),
        (0, 52, 24, 5),
        description="Stripes whose parity equals the encoding of their members (ecrec verify, and ecrec local "
        "after training), and stripes that did not.",
    ),
)


# The operator's own metrics (operator/ecrec_operator/metrics.py): one operator serves many jobs, so these are
# by the operator's namespace (its ServiceMonitor's target label), not by job.
OP_Y = max(p.grid[1] + p.grid[3] for p in PANELS)
OPERATOR_PANELS: tuple[Panel, ...] = (
    Panel(
        "Operator: reconcile passes and errors",
        "timeseries",
        (
            _t(
                f"sum by (namespace) (rate(ecrec_operator_reconciles_total[{RATE}]))",
                "passes/s {{namespace}}",
            ),
            _t(
                f"sum by (namespace, kind) (rate(ecrec_operator_errors_total[{RATE}]))",
                "errors/s {{kind}} {{namespace}}",
            ),
        ),
        (0, OP_Y, 12, 8),
        description="The operator's reconcile passes over ECRecJobs, and the actions that failed (retried on "
        "the next pass), by kind.",
    ),
    Panel(
        "Operator: actions",
        "timeseries",
        (_t(f"sum by (kind) (rate(ecrec_operator_actions_total[{RATE}]))", "{{kind}}"),),
        (12, OP_Y, 12, 8),
        description="Actions the reconciler decided per second, by kind (all jobs).",
    ),
    Panel(
        "Operator: pods created",
        "timeseries",
        (
            _t(
                f"sum by (role, replacement) (increase(ecrec_operator_pods_created_total[{RATE}]))",
                "{{role}} (replacement: {{replacement}})",
            ),
        ),
        (0, OP_Y + 8, 12, 8),
        description="Pods the operator created, by role, and whether each replaces a lost one.",
    ),
    Panel(
        "Operator: replacement latency",
        "timeseries",
        (
            _t(
                f"histogram_quantile(0.5, sum by (le) (rate(ecrec_operator_replacement_seconds_bucket[{RATE}])))",
                "p50",
            ),
            _t(
                f"histogram_quantile(0.99, sum by (le) (rate(ecrec_operator_replacement_seconds_bucket[{RATE}])))",
                "p99",
            ),
        ),
        (12, OP_Y + 8, 12, 8),
        unit="s",
        description="From a server pod seen lost to its replacement's recovery started.",
    ),
)


def _panel_json(i: int, p: Panel) -> dict:
    x, y, w, h = p.grid
    defaults: dict = {"unit": p.unit}
    options: dict = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}}
    if p.kind == "state-timeline":
        defaults["mappings"] = [
            {
                "type": "value",
                "options": {
                    str(v): {"text": name, "color": COLORS.get(name, "#8e8e8e"), "index": v}
                    for v, name in enumerate(p.states)
                },
            }
        ]
        defaults["color"] = {"mode": "fixed"}
        options |= {"showValue": "never", "mergeValues": True, "rowHeight": 0.8}
    elif p.kind == "timeseries":
        defaults["custom"] = {"lineWidth": 2, "fillOpacity": 10, "showPoints": "never", "spanNulls": False}
        options["tooltip"] = {"mode": "multi", "sort": "none"}
    else:
        options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}
        options |= {"colorMode": "value", "graphMode": "area", "textMode": "value_and_name"}
    return {
        "id": i + 1,
        "type": p.kind,
        "title": p.title,
        "description": p.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options,
        "targets": [
            {
                "refId": chr(ord("A") + j),
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "expr": t.expr,
                "legendFormat": t.legend,
                "range": True,
            }
            for j, t in enumerate(p.targets)
        ],
    }


NAMESPACE_VARIABLE_QUERY = "label_values(ecrec_training_step, namespace)"
JOB_VARIABLE_QUERY = 'label_values(ecrec_training_step{namespace="$namespace"}, ecrec_job)'


def _query_variable(name: str, label: str, query: str, ref: str) -> dict:
    """A template variable whose values a Prometheus query lists (one value chosen, refreshed on time change)."""
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {"query": query, "refId": ref},
        "definition": query,
        "refresh": 2,
        "sort": 1,
        "multi": False,
        "includeAll": False,
        "current": {},
        "hide": 0,
    }


def dashboard() -> dict:
    """The Grafana dashboard model (schemaVersion 39, Grafana 10/11)."""
    return {
        "uid": UID,
        "title": "ECRec job",
        "description": "Training, shard states, recovery and degraded traffic of an ECRec job, and the "
        "operator's reconciles (ecrec.dashboard)",
        "tags": ["ecrec"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "5s",
        "time": {"from": "now-30m", "to": "now"},
        "timezone": "browser",
        "graphTooltip": 1,
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                _query_variable("namespace", "Namespace", NAMESPACE_VARIABLE_QUERY, "namespaces"),
                _query_variable("ecrec_job", "Job", JOB_VARIABLE_QUERY, "jobs"),
            ]
        },
        "annotations": {"list": []},
        "panels": [_panel_json(i, p) for i, p in enumerate(PANELS + OPERATOR_PANELS)],
    }


def dashboard_json() -> str:
    """What `make dashboard` commits as charts/ecrec/dashboards/ecrec.json."""
    return json.dumps(dashboard(), indent=2) + "\n"


# -- what the queries name --------------------------------------------------------------------------------

PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "offset",
    "bool",
    "inf",
    "nan",
}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions, keywords, label
    names in grouping clauses, or inside label matchers, strings and range selectors."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    s = re.sub(r"\{[^}]*\}", "", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", "", s)  # ranges
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)  # grouping labels
    s = re.sub(
        r"(?<![A-Za-z0-9_:])\d[0-9.]*(e[+-]?\d+)?(ms|[smhdwy])*", " ", s
    )  # numbers, durations (offset 5m)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        word = m.group(0)
        after = s[m.end() :].lstrip()
        if after.startswith("(") or word.lower() in PROMQL_WORDS or word.startswith("$"):
            continue
        if m.start() > 0 and s[m.start() - 1] == "$":
            continue  # a Grafana variable
        names.add(word)
    return names


def queries() -> list[str]:
    """Every PromQL expression of the dashboard: its panels' and its variables'."""
    exprs = [t.expr for p in PANELS + OPERATOR_PANELS for t in p.targets]
    for variable in (NAMESPACE_VARIABLE_QUERY, JOB_VARIABLE_QUERY):
        exprs.append(variable.removeprefix("label_values(").rsplit(",", 1)[0])
    return exprs


# -- rendering from a real Prometheus ---------------------------------------------------------------------


def substitute(expr: str, job: str, rate_interval: str, namespace: str = "") -> str:
    """The query Grafana sends for `expr` with job `job` of `namespace` selected ("": series without a
    namespace label, as a local run's are)."""
    return (
        expr.replace("$namespace", namespace)
        .replace("$ecrec_job", job)
        .replace("$__rate_interval", rate_interval)
    )


def query_range(prometheus: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    from ecrec import rest

    r = rest.get(
        f"{prometheus.rstrip('/')}/api/v1/query_range",
        params={"query": expr, "start": start, "end": end, "step": step},
        timeout=30.0,
    )
    body = r.json()
    if r.status_code != 200 or body.get("status") != "success":
        raise RuntimeError(f"query_range {expr!r}: {r.status_code} {body.get('error', r.text[:200])}")
    return body["data"]["result"]


def job_window(
    prometheus: str,
    job: str,
    start: float | None = None,
    end: float | None = None,
    lookback: float = 6 * 3600,
) -> tuple[float, float]:
    """Where not given: when the job's training started (its first sample out of phase Pending) and its last
    sample, as `prometheus` has them from the last `lookback` seconds."""
    import time

    if start is not None and end is not None:
        return start, end
    now = time.time()
    sel = f'ecrec_job="{job}", role="coordinator", phase="Pending"'

    def times(expr: str) -> list[float]:
        return [
            float(ts)
            for res in query_range(prometheus, expr, now - lookback, now, 2.0)
            for ts, _ in res["values"]
        ]

    seen = times(f"ecrec_job_phase{{{sel}}}")
    if not seen:
        raise RuntimeError(f"{prometheus} has no series of job {job!r} in the last {lookback:g} s")
    started = times(f"ecrec_job_phase{{{sel}}} == 0") or seen
    return start if start is not None else min(started), end if end is not None else max(seen)


def legend(fmt: str, labels: dict) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)


def panel_data(
    prometheus: str,
    job: str,
    start: float,
    end: float,
    step: float = 1.0,
    rate_interval: str = "4s",
    namespace: str = "",
) -> dict[str, list[tuple[str, list[tuple[float, float]]]]]:
    """{panel title: [(legend, [(t, value)...]) per series]} of the job panels (`PANELS`, not the operator's)
    as Grafana would get it from `prometheus`."""
    out = {}
    for p in PANELS:
        series = []
        for t in p.targets:
            for res in query_range(
                prometheus, substitute(t.expr, job, rate_interval, namespace), start, end, step
            ):
                points = [(float(ts), float(v)) for ts, v in res["values"]]
                points = [(ts, v) for ts, v in points if math.isfinite(v)]
                series.append((legend(t.legend, res["metric"]), points))
        out[p.title] = series
    return out


def _fmt(value: float, unit: str) -> str:
    if unit == "percentunit":
        return f"{100 * value:.0f}%"
    if unit == "s":
        return f"{value:.3g} s"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


# Grafana's dark theme.
BACKGROUND, PANEL, BORDER, TEXT, MUTED = "#111217", "#181b1f", "#2c3235", "#d8d9da", "#9fa7b3"
PALETTE = ("#73bf69", "#f2cc0c", "#5794f2", "#ff9830", "#f2495c", "#b877d9", "#8ab8ff", "#ffb357", "#96d98d")


def render_png(
    data: dict, path: Path, start: float, end: float | None = None, title: str = "ECRec job"
) -> dict[str, int]:
    """Draw the panels from `panel_data` on Grafana's grid into a PNG, time in seconds since `start`; returns
    {panel title: points drawn}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter

    last = max((t for series in data.values() for _, pts in series for t, _ in pts), default=start + 1)
    xlim = (0.0, max(1.0, min(end or last, last) - start))
    width, row_h, header = 16.0, 0.36, 0.45  # inches: figure width, one grid row, the title bar
    rows = max(p.grid[1] + p.grid[3] for p in PANELS)
    height = rows * row_h + header
    fig = plt.figure(figsize=(width, height), facecolor=BACKGROUND)
    fig.text(0.006, 1 - 0.28 / height, title, color=TEXT, fontsize=13, va="center")
    col = width / 24

    def frac(x0: float, y0: float, w: float, h: float) -> tuple[float, float, float, float]:
        """Inches from the top left of the grid -> figure fractions."""
        return x0 / width, 1 - (header + y0 + h) / height, w / width, h / height

    drawn: dict[str, int] = {}
    for p in PANELS:
        gx, gy, gw, gh = p.grid
        px, py, pw, ph = gx * col + 0.04, gy * row_h + 0.04, gw * col - 0.08, gh * row_h - 0.08
        box = fig.add_axes(frac(px, py, pw, ph), facecolor=PANEL)
        box.set_xticks([])
        box.set_yticks([])
        for spine in box.spines.values():
            spine.set_color(BORDER)
        box.text(
            0.08 / pw, 1 - 0.16 / ph, p.title, color=TEXT, fontsize=10, va="center", transform=box.transAxes
        )
        left, right, top, bottom = (
            0.75,
            1.75,
            0.34,
            0.42,
        )  # room for tick labels, the legend, title, time axis
        if p.kind == "stat":
            left, right, bottom = 0.1, 0.1, 0.1
        ax = fig.add_axes(frac(px + left, py + top, pw - left - right, ph - top - bottom), facecolor=PANEL)
        ax.tick_params(colors=MUTED, labelsize=7, length=2)
        for spine in ax.spines.values():
            spine.set_visible(False)
        series = data.get(p.title, [])
        drawn[p.title] = sum(len(points) for _, points in series)
        if not drawn[p.title]:
            ax.set_xticks([])
            ax.set_yticks([])
            ax.text(0.5, 0.5, "No data", color=MUTED, ha="center", va="center", transform=ax.transAxes)
            continue
        legend_kw = dict(
            loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, labelcolor=TEXT, fontsize=7
        )
        if p.kind == "state-timeline":
            names = sorted({name for name, _ in series}, reverse=True)
            for name, points in series:
                row = names.index(name)
                for (t0, v), (t1, _) in zip(points, [*points[1:], (points[-1][0] + 1, 0)], strict=True):
                    state = p.states[int(v)] if 0 <= int(v) < len(p.states) else "?"
                    ax.barh(row, t1 - t0, left=t0 - start, color=COLORS.get(state, "#8e8e8e"), height=0.8)
            ax.set_yticks(range(len(names)), names)
            shown = {p.states[int(v)] for _, pts in series for _, v in pts if 0 <= int(v) < len(p.states)}
            ax.legend(handles=[Patch(color=COLORS[s], label=s) for s in p.states if s in shown], **legend_kw)
        elif p.kind == "stat":
            ax.set_xticks([])
            ax.set_yticks([])
            for i, (name, points) in enumerate(series):
                x = (i + 0.5) / len(series)
                color = PALETTE[0] if points[-1][1] == 0 or i == 0 else PALETTE[4]
                ax.text(x, 0.55, _fmt(points[-1][1], p.unit), color=color, fontsize=22, ha="center",
                        va="center", transform=ax.transAxes)  # fmt: skip
                ax.text(x, 0.12, name, color=TEXT, fontsize=9, ha="center", transform=ax.transAxes)
        else:
            for i, (name, points) in enumerate(series):
                ax.plot([t - start for t, _ in points], [v for _, v in points], label=name, linewidth=1.3,
                        color=PALETTE[i % len(PALETTE)], linestyle="-" if i % 2 == 0 else (0, (4, 2)))  # fmt: skip
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos, unit=p.unit: _fmt(v, unit)))
            ax.grid(color=BORDER, linewidth=0.6)
            ax.legend(**legend_kw)
        if p.kind != "stat":
            ax.set_xlim(*xlim)
            ax.set_xlabel("seconds since training started", color=MUTED, fontsize=7, labelpad=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80, facecolor=fig.get_facecolor())
    plt.close(fig)
    return drawn
