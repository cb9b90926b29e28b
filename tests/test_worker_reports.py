"""A worker's progress reports (ecrec.worker.ProgressReporter): the reporter thread's and the training thread's
reports reach the coordinator in the order they were read, and a refusal the reporter thread gets ends the
worker as it would on the training thread; a loss that is not finite goes as null (JSON has no NaN)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from ecrec.worker import CoordinatorLink, ProgressReporter


def Response(status: int, body: dict) -> httpx.Response:  # what the fake connections below answer
    return httpx.Response(status, json=body, request=httpx.Request("POST", "http://coordinator"))


def reporter_with(http) -> ProgressReporter:
    link = CoordinatorLink("http://coordinator", 0, "w0", incarnation=1, patience=1.0)
    link.coordinator.http = http  # CoordinatorClient's connection
    return ProgressReporter(link, interval=0.01)


def test_a_report_read_later_never_overtakes_one_still_on_the_wire():
    # The reporter thread read step 1 and its request is slow on the way; meanwhile the training thread
    # trains a step and posts at once (a checkpoint pause does). The coordinator refuses a report behind the
    # last one it took, so the second must not reach it first.
    received: list[int] = []
    first_on_wire, deliver_first = threading.Event(), threading.Event()

    class Http:
        def post(self, url, json):
            if json["step"] == 1:
                first_on_wire.set()
                deliver_first.wait(timeout=5)
            received.append(json["step"])
            return Response(200, {})

    reporter = reporter_with(Http())
    reporter.stepped(1, 64, 0.5, time.time())
    loop_report = threading.Thread(target=reporter._post)
    loop_report.start()
    assert first_on_wire.wait(timeout=5)
    reporter.stepped(2, 128, 0.4, time.time())
    training_report = threading.Thread(target=reporter.post_now)
    training_report.start()
    time.sleep(0.3)  # room for the second report to overtake the first, if it could
    deliver_first.set()
    loop_report.join(timeout=5)
    training_report.join(timeout=5)
    assert received == [1, 2]


def test_a_refusal_on_the_reporter_thread_ends_the_worker_at_its_next_step():
    # A coordinator that does not admit this process refuses its reports and its rejoin (409). On the training
    # thread that is SystemExit(2); the reporter thread must not just die quietly and leave a worker that
    # trains on, unreported, until it is declared unresponsive and replaced.
    class Http:
        def post(self, url, json):
            return Response(409, {"detail": "worker 0: not a process this coordinator admits"})

    reporter = reporter_with(Http())
    reporter.start()
    end = time.monotonic() + 5
    with pytest.raises(SystemExit) as refused:
        while time.monotonic() < end:
            reporter.stepped(1, 64, 0.5, time.time())
            time.sleep(0.01)
    assert refused.value.code == 2


def test_progress_reports_send_null_for_a_non_finite_loss() -> None:
    sent = []

    class Http:
        def post(self, url, json):
            sent.append(json)
            return Response(200, {})

    reporter = reporter_with(Http())
    for loss, expected in ((0.25, 0.25), (float("nan"), None), (None, None)):
        reporter.loss = loss
        reporter._post()
        assert sent[-1]["loss"] == expected
