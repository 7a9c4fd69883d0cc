"""The audit's comparison and report on hand-made arrays (the audit of real outputs: tests/e2e/test_audit.py)."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.tools.audit import AuditReport, LayerResult, Thresholds, compare
from pipeline.cli import main


def test_compare_identical_scaled_orthogonal_and_misshaped():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 8)).astype(np.float32)
    r = compare("s", "final", x, x)
    assert r.tokens == 6 and r.mean_cosine == pytest.approx(1.0) and r.min_cosine == pytest.approx(1.0) and r.max_abs_diff == 0
    y = x.copy()
    y[4] = -y[4]  # one token flipped
    r = compare("s", "final", y, x)
    assert r.worst_token == 4 and r.min_cosine == pytest.approx(-1.0) and r.mean_cosine == pytest.approx(4 / 6)
    assert r.max_abs_diff == pytest.approx(2 * np.abs(x[4]).max())
    r = compare("s", "final", x[:5], x)  # a truncated sample
    assert (r.mean_cosine, r.min_cosine, r.max_abs_diff) == (0.0, 0.0, float("inf"))
    z = np.zeros_like(x)
    assert compare("s", "final", z, z).min_cosine == 1.0  # both zero: equal
    assert compare("s", "final", z, x).min_cosine == 0.0  # one zero: no direction in common
    assert compare("s", "final", np.zeros((0, 8)), np.zeros((0, 8))).tokens == 0


def _result(sid, layer, mean, low):
    return LayerResult(sid, layer, 10, mean, low, 0, 0.1)


def test_report_names_a_failing_sample_even_when_a_passing_one_has_a_lower_mean():
    report = AuditReport("out", "model", "cpu", Thresholds(0.9995, 0.99), samples=["a", "b"])
    report.results = [_result("a", "aux layer 2", 0.99960, 0.995), _result("b", "final", 0.99990, 0.95)]
    assert not report.ok and [r.sample_id for r in report.failures] == ["b"]
    assert report.worst().sample_id == "b"
    text = report.text()
    assert "FAIL: 1 sample/layer pairs" in text and "sample 'b', final" in text
    report.results[1] = _result("b", "final", 0.99990, 0.995)
    assert report.ok and "PASS" in report.text()
    assert report.worst().sample_id == "a"  # no failures: the lowest mean
    per = report.per_layer()
    assert set(per) == {"aux layer 2", "final"} and per["final"]["tokens"] == 10


def test_an_empty_report_fails():
    report = AuditReport("out", "model", "cpu", Thresholds())
    assert not report.ok and report.worst() is None and "nothing to audit" in report.text()
    assert report.to_json()["passed"] is False


def test_cli_audit_of_a_directory_without_manifest_is_refused(tmp_path, capsys):
    assert main(["audit", str(tmp_path)]) == 2
    assert "no manifest.json" in capsys.readouterr().err


def test_a_scaled_layer_passes_cosine_but_fails_the_norm_check():
    x = np.random.default_rng(1).standard_normal((6, 8)).astype(np.float32)
    noisy = x * (1 + 1e-3 * np.random.default_rng(2).standard_normal(x.shape)).astype(np.float32)
    ok = compare("s", "aux layer 2", noisy, x)
    assert ok.passes(Thresholds()) and ok.norm_error < 0.01
    doubled = compare("s", "aux layer 2", 2 * x, x)
    assert doubled.mean_cosine == pytest.approx(1.0) and doubled.norm_error == pytest.approx(1.0)
    assert not doubled.passes(Thresholds())
    report = AuditReport("out", "model", "cpu", Thresholds(), samples=["s"], results=[ok, doubled])
    assert report.worst() is doubled and "norm error 1.0000" in report.text()
