"""The audit's comparison and report on hand-made arrays (the audit of real outputs: tests/e2e/test_audit.py;
the rule itself on the real model: test_fidelity.py)."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.cli import main
from pipeline.tools.audit import AuditReport, compare
from pipeline.tools.fidelity import DEFAULT_RULE


def _pair(seed=0, noise=0.01):
    rng = np.random.default_rng(seed)
    truth = rng.standard_normal((6, 8))
    return truth, truth * (1 + noise * rng.standard_normal(truth.shape))


def test_compare_identical_flipped_truncated_and_zero():
    truth, yard = _pair()
    r = compare("s", "final", truth, truth, yard)
    assert (
        r.passed and r.tokens == 6 and r.mean_cosine == pytest.approx(1.0) and r.max_abs_diff == 0 and r.mean_error == 0
    )
    y = truth.copy()
    y[4] = -y[4]  # one token flipped
    r = compare("s", "final", y, truth, yard)
    assert (
        not r.passed
        and r.worst_token == 4
        and r.min_cosine == pytest.approx(-1.0)
        and r.worst_error == pytest.approx(2.0)
    )
    assert r.max_abs_diff == pytest.approx(2 * np.abs(truth[4]).max())
    r = compare("s", "final", truth[:5], truth, yard)  # a truncated sample
    assert not r.passed and r.max_abs_diff == float("inf")
    z = np.zeros_like(truth)
    assert compare("s", "final", z, z, z).passed  # both zero: equal
    assert not compare("s", "final", z, truth, yard).passed
    assert compare("s", "final", np.zeros((0, 8)), np.zeros((0, 8)), np.zeros((0, 8))).tokens == 0


def test_a_scaled_layer_has_perfect_cosine_but_fails():
    truth, yard = _pair(1)
    doubled = compare("s", "aux layer 2", 2 * truth, truth, yard)
    assert doubled.mean_cosine == pytest.approx(1.0) and not doubled.passed and doubled.mean_error == pytest.approx(1.0)


def test_report_names_the_failure_furthest_past_its_allowance():
    truth, yard = _pair(2)
    ok = compare("a", "aux layer 2", yard, truth, yard)
    bad = truth.copy()
    bad[3] *= 1.5  # one token 50 % too large
    one_token = compare("b", "final", bad, truth, yard)
    swapped = compare("c", "final", _pair(3)[0], truth, yard)
    report = AuditReport("out", "model", "cpu", DEFAULT_RULE, samples=["a", "b", "c"], results=[ok, one_token, swapped])
    assert not report.ok and [r.sample_id for r in report.failures] == ["b", "c"]
    assert report.worst().sample_id == "c"
    text = report.text()
    assert "FAIL: 2 sample/layer pairs" in text and "sample 'c', final" in text and "rule:" in text
    js = report.to_json()
    assert js["passed"] is False and js["rule"]["sample_factor"] == DEFAULT_RULE.sample_factor and js["worst"]["why"]
    report.results = [ok]
    assert report.ok and "PASS" in report.text() and report.worst().sample_id == "a"
    per = report.per_layer()
    assert set(per) == {"aux layer 2"} and per["aux layer 2"]["tokens"] == 6 and per["aux layer 2"]["failed"] == 0


def test_an_empty_report_fails():
    report = AuditReport("out", "model", "cpu", DEFAULT_RULE)
    assert not report.ok and report.worst() is None and "nothing to audit" in report.text()
    assert report.to_json()["passed"] is False


def test_cli_audit_of_a_directory_without_manifest_is_refused(tmp_path, capsys):
    assert main(["audit", str(tmp_path)]) == 2
    assert "no manifest.json" in capsys.readouterr().err
