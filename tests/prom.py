"""Real Prometheus for tests: Debian's prometheus and promtool (hack/fetch-prometheus), a Prometheus server on
127.0.0.1 scraping an `ecrec local` job's coordinator, and that job with a server kill.

Run as a script it renders the dashboard from such a run (what docs/images/dashboard.png is):

    .venv/bin/python -m tests.prom --png docs/images/dashboard.png
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from ecrec.forkserver import die_with
from tests.conftest import ctrl_c_reaches_it

REPO = Path(__file__).resolve().parents[1]
FETCH = REPO / "hack" / "fetch-prometheus"


class Missing(RuntimeError):
    """Prometheus or promtool is not there and could not be fetched."""


def prometheus_bin(name: str) -> str:
    """The path of `prometheus` or `promtool`, fetched into the cache by hack/fetch-prometheus if needed."""
    proc = subprocess.run([str(FETCH)], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise Missing(
            f"hack/fetch-prometheus failed (exit {proc.returncode}); `make test` runs it first:\n{proc.stderr}"
        )
    path = Path(proc.stdout.strip().splitlines()[-1]) / name
    if not os.access(path, os.X_OK):
        raise Missing(f"{path} is missing after hack/fetch-prometheus")
    return str(path)


def promtool_check_metrics(text: str) -> tuple[int, str]:
    """`promtool check metrics` on an exposition: (exit code, what it said). Lint problems exit non-zero."""
    proc = subprocess.run(
        [prometheus_bin("promtool"), "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """A Prometheus server on 127.0.0.1 with its own storage in `workdir`, scraping every `interval` seconds
    the targets written with `set_targets` (file-based service discovery, so targets can come later)."""

    def __init__(self, workdir: Path, interval: float = 1.0):
        self.dir, self.interval = workdir, interval
        self.dir.mkdir(parents=True, exist_ok=True)
        self.targets_file = self.dir / "targets.json"
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = self.dir / "prometheus.log"

    def start(self, timeout: float = 120.0) -> None:
        self.set_targets([])
        config = {
            "global": {
                "scrape_interval": f"{self.interval:g}s",
                "evaluation_interval": f"{self.interval:g}s",
            },
            "scrape_configs": [
                {
                    "job_name": "ecrec",
                    "scrape_interval": f"{self.interval:g}s",
                    "scrape_timeout": f"{self.interval:g}s",
                    "file_sd_configs": [{"files": [str(self.targets_file)], "refresh_interval": "1s"}],
                }
            ],
        }
        (self.dir / "prometheus.yml").write_text(json.dumps(config, indent=2))  # JSON is YAML
        argv = [
            prometheus_bin("prometheus"),
            f"--config.file={self.dir / 'prometheus.yml'}",
            f"--storage.tsdb.path={self.dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=1d",
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.dir,
                start_new_session=True,
                preexec_fn=die_with(os.getpid()),  # the child must not outlive a killed test run
            )
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready after {timeout:g}s:\n{self.log_tail()}")

    def set_targets(self, targets: list[str], labels: dict | None = None) -> None:
        self.set_groups([{"targets": targets, "labels": labels or {}}])

    def set_groups(self, groups: list[dict]) -> None:
        """The file_sd target groups ([{"targets": [host:port], "labels": {...}}]) to scrape from now on."""
        tmp = self.targets_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        tmp.replace(self.targets_file)  # atomically: Prometheus must never read half a file

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr} | ({"time": at} if at is not None else {})
        r = httpx.get(f"{self.url}/api/v1/query", params=params, timeout=30.0)
        body = r.json()
        if body.get("status") != "success":
            raise RuntimeError(f"query {expr!r}: {body}")
        return body["data"]["result"]

    def value(self, expr: str, at: float | None = None) -> float | None:
        """The single value of an instant query, or None when it returns nothing."""
        result = self.query(expr, at)
        if not result:
            return None
        assert len(result) == 1, f"{expr}: {len(result)} series"
        return float(result[0]["value"][1])

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class JobFailed(AssertionError):
    pass


def _logs(out: Path, lines: int = 15) -> str:
    parts = []
    for log in sorted((out / "logs").glob("*.log")) if (out / "logs").exists() else []:
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {log.name}\n" + "\n".join(tail))
    launcher = out / "launcher.log"
    if launcher.exists():
        parts.append("--- launcher\n" + "\n".join(launcher.read_text(errors="replace").splitlines()[-lines:]))
    return "\n".join(parts)


@dataclass
class Job:
    """An `ecrec local` job running in the background (see `local_job`)."""

    proc: subprocess.Popen
    out: Path
    coordinator: str = ""
    name: str = ""

    def wait(self, what: str, check, timeout: float):
        """Poll `check()` until it returns something truthy; fail with the job's logs if the job exits first
        or `timeout` passes (a bound on waiting: a broken job fails the test instead of hanging it)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            value = check()
            if value:
                return value
            if self.proc.poll() is not None:
                raise JobFailed(
                    f"the job exited ({self.proc.returncode}) while waiting for {what}:\n{self.logs()}"
                )
            time.sleep(0.5)
        raise JobFailed(f"gave up waiting for {what} after {timeout:g}s:\n{self.logs()}")

    def logs(self) -> str:
        return _logs(self.out)

    def status(self) -> dict:
        return httpx.get(f"{self.coordinator}/v1/status", timeout=10).json()

    def recovered(self) -> bool:
        """Has the coordinator completed a recovery (and is every shard up again)?"""
        st = self.status()
        done = any(r["state"] == "completed" for r in st["recoveries"])
        return done and all(s["state"] == "up" for s in st["cluster"]["shards"])

    def worker_metrics_url(self, rank: int = 0) -> str:
        """What the worker logged at start: `metrics on http://...`."""
        for line in (self.out / "logs" / f"worker-{rank}.log").read_text(errors="replace").splitlines():
            if "metrics on " in line:
                return line.split("metrics on ", 1)[1].strip()
        raise JobFailed(f"worker {rank} did not log its metrics URL:\n{self.logs()}")

    def verify_argv(self) -> list[str]:
        """`ecrec verify` of this job, with the job token `ecrec local` wrote (reads need none, its report does)."""
        argv = [sys.executable, "-m", "ecrec.cli", "verify", "--coordinator", self.coordinator]
        token = self.out / "job.token"
        return argv + (["--token-file", str(token)] if token.exists() else [])

    def stop(self) -> int:
        """Ctrl-C: the launcher stops every process it started."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


# The tiny model, training until it is stopped: the tests stop it once they have seen what they wait for.
ENDLESS = ("model.preset=tiny", "training.steps=100000")


# The killed server's replacement starts 3 s after its death: what these jobs are scraped for (the shard seen
# failed, degraded reads and writes) happens however fast the machine. A local replacement is otherwise up in
# ~0.1 s, and one CI run's workers made no degraded read before it was.
REPLACE_AFTER = ("--replace-after", "3")


@contextmanager
def local_job(
    out: Path, sets: tuple[str, ...] = ENDLESS, kill: str = "2@3", args: tuple[str, ...] = REPLACE_AFTER
):
    """`ecrec local examples/local-small.yaml --kill KILL ARGS` (ECRec k=4 on 5 servers, 2 workers) in the
    background; yields a `Job` once its coordinator answers, and stops it on exit."""
    out.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable,
        "-m",
        "ecrec.cli",
        "local",
        "examples/local-small.yaml",
        "--quiet",
        "--out",
        str(out),
    ]
    argv += [a for s in sets for a in ("--set", s)] + (["--kill", kill] if kill else []) + list(args)
    with open(out / "launcher.log", "ab") as log:
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=ctrl_c_reaches_it,
        )
    job = Job(proc, out)
    try:
        url_file = out / "coordinator.url"
        job.coordinator = job.wait("the coordinator", lambda: url_file.exists() and url_file.read_text(), 180)
        job.name = httpx.get(f"{job.coordinator}/v1/job", timeout=10).json()["name"]
        yield job
    finally:
        job.stop()


@dataclass
class Run:
    """An `ecrec local` job scraped by a real Prometheus: what the tests query afterwards."""

    prometheus: Prometheus
    job: Job
    started_at: float  # when its training started (unix time)
    ended_at: float
    verify: dict  # `ecrec verify`'s result after the recovery
    exit_code: int  # the launcher's


@contextmanager
def prometheus_run(workdir: Path, sets: tuple[str, ...] = ENDLESS, kill: str = "2@3"):
    """Prometheus, then a `local_job` scraped by it. Waits until Prometheus shows the recovery completed, runs
    `ecrec verify` and waits until Prometheus shows its result; then stops the job. Yields a `Run`;
    Prometheus is stopped on exit, always."""
    prom = Prometheus(workdir / "prometheus")
    try:
        prom.start()
        with local_job(workdir / "job", sets, kill) as job:
            prom.set_targets([job.coordinator.removeprefix("http://")])
            sel = f'ecrec_job="{job.name}", role="coordinator"'
            job.wait(
                "Prometheus to show the recovery completed",
                lambda: (prom.value(f"ecrec_recoveries_completed_total{{{sel}}}") or 0) >= 1,
                300,
            )
            started = job.status()["startedAt"]
            verify = subprocess.run(
                job.verify_argv(),
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=300,
            )
            if verify.returncode != 0:
                raise JobFailed(f"ecrec verify failed ({verify.returncode}): {verify.stdout}{verify.stderr}")
            result = json.loads(verify.stdout.strip().splitlines()[-1])
            job.wait(
                "Prometheus to show the parity check",
                lambda: (prom.value(f'ecrec_parity_check_stripes_total{{{sel}, result="ok"}}') or 0) > 0,
                60,
            )
            code = job.stop()
        yield Run(prom, job, started, time.time(), result, code)
    finally:
        prom.stop()


def _verify(job: Job) -> None:
    subprocess.run(
        job.verify_argv(),
        cwd=REPO,
        capture_output=True,
        timeout=300,
    )


def record(workdir: Path, sets: tuple[str, ...], kill: str) -> dict:
    """A finite job with a kill, scraped by Prometheus from start to end, `ecrec verify` run once its recovery
    completed (if it is still training then): what every panel's queries answer."""
    from ecrec import dashboard

    prom = Prometheus(workdir / "prometheus")
    try:
        prom.start()
        with local_job(workdir / "job", sets, kill) as job:
            prom.set_targets([job.coordinator.removeprefix("http://")])
            started = job.wait("training to start", lambda: job.status()["startedAt"], 300)
            verified = False
            while job.proc.poll() is None:
                try:
                    if not verified and job.recovered():
                        _verify(job)
                        verified = True
                except httpx.HTTPError:
                    pass  # it stopped meanwhile
                time.sleep(0.5)
            ended = time.time()
        data = dashboard.panel_data(prom.url, job.name, started - 2, ended)
        return {
            "job": job.name,
            "sets": list(sets),
            "kill": kill,
            "start": started,
            "end": ended,
            "data": data,
        }
    finally:
        prom.stop()


def main() -> None:
    from ecrec import dashboard

    ap = argparse.ArgumentParser(
        description="run a job with a kill under a real Prometheus; render the dashboard"
    )
    ap.add_argument("--png", default="docs/images/dashboard.png")
    ap.add_argument("--set", action="append", default=[], metavar="PATH=VALUE", help="spec overrides")
    ap.add_argument("--kill", default="2@8")
    ap.add_argument("--save-data", help="also write what Prometheus answered to this JSON file")
    ap.add_argument("--from-data", help="render from a --save-data file instead of running a job")
    args = ap.parse_args()
    if args.from_data:
        saved = json.loads(Path(args.from_data).read_text())
    else:
        with tempfile.TemporaryDirectory(prefix="ecrec-dashboard-") as tmp:
            saved = record(Path(tmp), tuple(args.set), args.kill)
        if args.save_data:
            Path(args.save_data).write_text(json.dumps(saved))
    sets = "".join(f" --set {s}" for s in saved.get("sets", []))
    title = f"ecrec local examples/local-small.yaml{sets} --kill {saved['kill']} {' '.join(REPLACE_AFTER)}   (Prometheus: job {saved['job']})"
    drawn = dashboard.render_png(saved["data"], Path(args.png), saved["start"], saved["end"], title=title)
    empty = [title for title, n in drawn.items() if not n]
    print(f"wrote {args.png}" + (f"; no data for: {', '.join(empty)}" if empty else ""))


if __name__ == "__main__":
    main()
