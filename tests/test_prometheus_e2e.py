"""A real Prometheus (Debian's 2.42, hack/fetch-prometheus) scrapes an `ecrec local` job whose server 2 is
SIGKILLed: the failure and the recovery are visible through Prometheus's HTTP query API under Prometheus's own
`job`/`instance` target labels, and the Grafana dashboard's panels render from the run with data in every one.
Prometheus runs on 127.0.0.1 with its own storage under the test's temp dir and is stopped at the end, always."""

from __future__ import annotations

import pytest

from ecrec import cli, dashboard
from tests.conftest import processes_mentioning
from tests.prom import ENDLESS, prometheus_run

# The module's run (a job trained until its recovery shows in Prometheus) counts toward the first test's time.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


# Lock groups of 8 rows: the tiny model's shard (860 rows) is rebuilt in ~100 groups, seconds of `recovering`
# that 1 s scrapes see. (A replacement forked from the fork server registers within a fraction of a second,
# and the whole rebuild in one group took less: scrapes could miss shard 2's failure altogether.)
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    with prometheus_run(
        tmp_path_factory.mktemp("prom-e2e"), (*ENDLESS, "faultTolerance.ecrec.lockGroupRows=8")
    ) as r:
        yield r


def over_run(run, expr: str) -> float | None:
    """`expr` over the whole run, evaluated at its end (the job's series are stale after it stopped)."""
    window = int(run.ended_at - run.started_at) + 60
    return run.prometheus.value(expr.replace("[RUN]", f"[{window}s]"), at=run.ended_at)


def test_recovery_is_visible_through_the_prometheus_query_api(run):
    assert run.exit_code == 130, run.job.logs()  # stopped with Ctrl-C by the fixture, not failed
    sel = f'ecrec_job="{run.job.name}", role="coordinator"'
    # Prometheus's own target labels are there, ours is not renamed (no exported_job).
    (up,) = run.prometheus.query('max_over_time(up{job="ecrec"}[10m])', at=run.ended_at)
    assert up["value"][1] == "1" and up["metric"]["instance"] == run.job.coordinator.removeprefix("http://")
    series = run.prometheus.query(f"last_over_time(ecrec_training_step{{{sel}}}[10m])", at=run.ended_at)
    assert len(series) == 1 and series[0]["metric"]["job"] == "ecrec", series
    assert not run.prometheus.query('count({__name__=~"ecrec_.+", exported_job!=""})', at=run.ended_at)

    assert over_run(run, f"max_over_time(ecrec_failures_detected_total{{{sel}}}[RUN])") >= 1
    assert over_run(run, f"max_over_time(ecrec_recoveries_completed_total{{{sel}}}[RUN])") >= 1
    # Shard 2 was seen failed or recovering, and up again in its second incarnation with its recovery completed.
    was_down = over_run(
        run, f'max(max_over_time(ecrec_shard_state{{{sel}, shard="2", state=~"failed|recovering"}}[RUN]))'
    )
    assert was_down == 1
    assert over_run(run, f'last_over_time(ecrec_shard_state{{{sel}, shard="2", state="up"}}[RUN])') == 1
    assert over_run(run, f'last_over_time(ecrec_shard_incarnation{{{sel}, shard="2"}}[RUN])') == 2
    assert (
        over_run(run, f'last_over_time(ecrec_recovery_phase{{{sel}, shard="2", phase="completed"}}[RUN])')
        == 1
    )
    groups = over_run(run, f'last_over_time(ecrec_recovery_lock_groups{{{sel}, shard="2"}}[RUN])')
    assert groups > 0
    assert (
        over_run(run, f'last_over_time(ecrec_recovery_lock_groups_done{{{sel}, shard="2"}}[RUN])') == groups
    )
    assert over_run(run, f'max_over_time(ecrec_recovery_rows_rebuilt{{{sel}, shard="2"}}[RUN])') > 0
    assert over_run(run, f"max_over_time(ecrec_time_to_recover_seconds_count{{{sel}}}[RUN])") >= 1
    assert over_run(run, f'max_over_time(ecrec_degraded_reads_total{{{sel}, shard="2"}}[RUN])') > 0
    # The parity check `ecrec verify` ran after the recovery.
    ok = over_run(run, f'max_over_time(ecrec_parity_check_stripes_total{{{sel}, result="ok"}}[RUN])')
    assert ok == run.verify["stripes"] - run.verify["mismatches"] > 0
    assert (
        over_run(run, f'max_over_time(ecrec_parity_check_stripes_total{{{sel}, result="mismatch"}}[RUN])')
        == 0
    )
    assert processes_mentioning(str(run.job.out)) == []


def test_every_dashboard_panel_renders_with_data_from_the_run(run, tmp_path):
    data = dashboard.panel_data(run.prometheus.url, run.job.name, run.started_at - 2, run.ended_at)
    png = tmp_path / "dashboard.png"
    drawn = dashboard.render_png(data, png, run.started_at, run.ended_at, title=f"ECRec job {run.job.name}")
    assert set(drawn) == {p.title for p in dashboard.PANELS}
    assert [title for title, n in drawn.items() if n == 0] == [], "panels without data"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The state timeline shows shard 2 leaving `up` (1) and coming back.
    (shard2,) = [points for name, points in data["Shard states"] if name == "shard 2"]
    codes = [v for _, v in shard2]
    assert codes[-1] == 1 and any(v in (2, 3) for v in codes), codes


def test_ecrec_dashboard_png_renders_the_run_from_prometheus(run, tmp_path, capsys):
    png = tmp_path / "cli.png"
    with pytest.raises(SystemExit) as info:
        cli.main(["dashboard", "--png", str(png), "--prometheus", run.prometheus.url, "--job", run.job.name])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.strip() == f"wrote {png}", out  # "; no data for: ..." would name empty panels
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The first sample out of phase Pending: Prometheus stamps a sample with its scrape's start, at most the
    # scrape timeout (1 s) before the coordinator answered.
    start, end = dashboard.job_window(run.prometheus.url, run.job.name)
    assert run.started_at - 1 <= start < end <= run.ended_at
