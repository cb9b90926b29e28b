"""A started job runs by the spec it started with (ecrec_operator.pinning), and the operator says what of an
edit it did not apply (the SpecChangeIgnored condition and event). On a real API server:
tests/k8s/test_operator_e2e.py::test_a_deleted_server_pod_is_replaced_and_rebuilt_while_training_goes_on."""

from __future__ import annotations

import copy
import datetime
import json

import pytest
import yaml

from ecrec.spec import job_from_spec
from ecrec_operator import handlers, pinning
from tests.conftest import REPO

SPEC = yaml.safe_load((REPO / "examples" / "k8s-small.yaml").read_text())["spec"]
NOW = datetime.datetime(2026, 11, 27, tzinfo=datetime.UTC)


def edited(**paths) -> dict:
    spec = copy.deepcopy(SPEC)
    for path, value in paths.items():
        *parents, leaf = path.split("__")
        node = spec
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return spec


PINNED = pinning.pin(job_from_spec("job", SPEC))


def test_an_unchanged_spec_resolves_to_itself_with_nothing_ignored() -> None:
    r = pinning.resolve("job", SPEC, PINNED)
    assert r.ignored == () and r.invalid is None and r.message() == ""
    assert r.job.spec == job_from_spec("job", SPEC).spec


def test_a_field_written_out_at_its_default_is_no_change() -> None:
    default = job_from_spec("job", SPEC).spec.training.momentum
    assert pinning.resolve("job", edited(training__momentum=default), PINNED).ignored == ()


def test_an_edit_is_not_applied_and_named_but_run_policy_is_taken_from_the_live_spec() -> None:
    live = edited(
        servers__replicas=6, training__steps=10, faultTolerance__ecrec__k=2, runPolicy__backoffLimit=3
    )
    r = pinning.resolve("job", live, PINNED)
    assert r.ignored == ("faultTolerance.ecrec.k", "servers.replicas", "training.steps")
    spec = r.job.spec
    assert (spec.servers.replicas, spec.training.steps, spec.fault_tolerance.ecrec.k) == (5, 300, 4)
    assert spec.run_policy.backoff_limit == 3
    assert "servers.replicas" in r.message() and "only runPolicy" in r.message()


def test_an_invalid_edit_is_reported_and_nothing_of_it_applied() -> None:
    r = pinning.resolve("job", edited(servers__replicas=0, runPolicy__backoffLimit=3), PINNED)
    assert r.invalid and "servers.replicas" in r.invalid and r.ignored == ()
    assert r.job.spec.servers.replicas == 5 and r.job.spec.run_policy.backoff_limit == 10
    assert "invalid" in r.message()


def test_the_pin_is_normalized_json_of_the_whole_spec() -> None:
    doc = json.loads(PINNED)
    assert doc == job_from_spec("job", SPEC).spec.to_dict()
    assert PINNED == pinning.pin(job_from_spec("job", json.loads(PINNED)))  # stable through a round trip


def test_differences_name_every_changed_leaf() -> None:
    a = {"x": {"y": 1, "z": [1, 2]}, "w": 0}
    b = {"x": {"y": 2, "z": [1, 2], "n": None}, "v": 1}
    assert pinning.differences(a, b) == ["v", "w", "x.y"]


@pytest.fixture
def warnings(monkeypatch):
    seen: list[str] = []
    monkeypatch.setattr(
        handlers.kopf, "warn", lambda obj, reason, message: seen.append(f"{reason}: {message}")
    )
    return seen


def test_the_condition_appears_with_one_event_per_new_message_and_turns_false_when_undone(warnings) -> None:
    unchanged = pinning.resolve("job", SPEC, PINNED)
    assert handlers._spec_condition({}, [], unchanged, NOW) == []  # never differed: no condition

    one = pinning.resolve("job", edited(servers__replicas=6), PINNED)
    conds = handlers._spec_condition({}, [], one, NOW)
    [c] = conds
    assert (c["type"], c["status"], c["reason"]) == ("SpecChangeIgnored", "True", "SpecChangeIgnored")
    assert len(warnings) == 1 and "servers.replicas" in warnings[0]
    assert handlers._spec_condition({}, conds, one, NOW) == conds and len(warnings) == 1  # no repeat

    two = pinning.resolve("job", edited(servers__replicas=6, training__steps=9), PINNED)
    conds = handlers._spec_condition({}, conds, two, NOW)
    assert len(warnings) == 2 and "training.steps" in conds[0]["message"]

    conds = handlers._spec_condition({}, conds, unchanged, NOW)  # the edit undone
    assert conds[0]["status"] == "False" and len(warnings) == 2
    assert handlers._spec_condition({}, conds, unchanged, NOW) == conds
