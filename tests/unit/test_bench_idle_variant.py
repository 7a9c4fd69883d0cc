"""bench_cpu_share --idle-variant: the Ray settings of an idle phase reach Ray as its own RAY_ variables, and a
setting that is not Ray's is refused rather than silently measured as if it were."""

import argparse

import pytest

from bench.bench_cpu_share import idle_variant


def test_idle_variant_reads_name_and_ray_settings():
    name, env = idle_variant("slow:RAY_metrics_report_interval_ms=60000,RAY_event_stats=0")
    assert name == "slow"
    assert env == {"RAY_metrics_report_interval_ms": "60000", "RAY_event_stats": "0"}


@pytest.mark.parametrize(
    "text",
    [
        "slow",
        "slow:",
        ":RAY_event_stats=0",
        "slow:OMP_NUM_THREADS=1",
        "slow:RAY_x",
        "slow:RAY_event_stats=0,junk",
        "with_dashboard:RAY_event_stats=0",
    ],
)
def test_idle_variant_refuses_what_is_not_a_ray_setting(text):
    with pytest.raises(argparse.ArgumentTypeError):
        idle_variant(text)
