from pathlib import Path

from pipeline.cli import main


def test_unknown_config_key_is_refused_with_its_name(capsys):
    assert main(["run", "conf/default.yaml", "--set", "engine.tp_sise=2"]) == 2
    err = capsys.readouterr().err
    assert "engine.tp_sise: unknown key" in err


def test_missing_config_file_is_refused(capsys):
    assert main(["run", "conf/nope.yaml"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_verify_of_a_directory_without_manifest_fails(tmp_path, capsys):
    assert main(["verify", str(tmp_path)]) == 1
    assert "no manifest.json" in capsys.readouterr().out


def test_a_failure_inside_ray_is_one_line_naming_its_root_cause():
    import errno

    from pipeline.driver.failures import failure_message, root_cause

    class TaskError(RuntimeError):  # Ray's task errors carry the remote exception as `.cause`
        def __init__(self, cause):
            super().__init__("Traceback (most recent call last):\n  ...long remote traceback...")
            self.cause = cause

    full = OSError(errno.ENOSPC, "No space left on device")
    try:
        try:
            raise TaskError(full)
        except TaskError as inner:
            raise RuntimeError("dataset failed") from inner
    except RuntimeError as outer:
        assert root_cause(outer) is full
        msg = failure_message(outer)
    assert msg.startswith("the run failed: OSError: [Errno 28] No space left on device.")
    assert "storage is full" in msg and "\n" not in msg and "Traceback" not in msg


def test_credentials_are_redacted_from_failure_messages(monkeypatch):
    from pipeline.driver.failures import failure_message

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "very-secret-value")
    msg = failure_message(RuntimeError("signature for very-secret-value failed at s3://user:pw@host/x"))
    assert "very-secret-value" not in msg and "user:pw" not in msg and "***" in msg


def test_an_actor_that_died_starting_is_named_by_its_own_error_not_ray_datas_marker():
    """Ray Data re-raises `from SystemException()` (an empty marker), and an actor that died in its constructor
    keeps its error only as text: the message names the constructor's own error."""
    import traceback

    from ray.data.exceptions import SystemException
    from ray.exceptions import ActorDiedError, RayTaskError

    from pipeline.driver.failures import failure_message

    try:
        raise RuntimeError("the SGLang server exited with code 1 before it was ready: no CPU attention backend")
    except RuntimeError as e:
        task_error = RayTaskError("MapWorker(HiddenStateExtractor).__init__", traceback.format_exc(), e)
    died = ActorDiedError(task_error)
    try:
        try:
            raise died
        except ActorDiedError as e:
            raise e.with_traceback(None) from SystemException()
    except ActorDiedError as outer:
        msg = failure_message(outer)
    assert "SystemException" not in msg and "\n" not in msg, msg
    assert msg.startswith(
        "the run failed: RuntimeError: the SGLang server exited with code 1 before it was ready: no CPU attention"
    ), msg


def test_a_bare_assert_in_a_remote_traceback_is_named_by_its_source_line():
    from pipeline.driver.failures import describe

    text = (
        "The actor died because of an error raised in its creation task, ray::MapWorker.__init__() (pid=1)\n"
        '  File "/x/site-packages/sglang/srt/layers/rotary_embedding/factory.py", line 478, in get_rope_cpu\n'
        "    assert rope_scaling is not None\n"
        "           ^^^^^^^^^^^^^^^^^^^^^^^^\n"
        "AssertionError"
    )
    assert describe(RuntimeError(text)) == (
        "AssertionError at sglang/srt/layers/rotary_embedding/factory.py:478: assert rope_scaling is not None"
    )


def test_regenerate_needs_a_generate_section_and_run_an_output(tmp_path, capsys):
    assert main(["regenerate", "conf/default.yaml"]) == 2
    assert "needs a generate section" in capsys.readouterr().err
    conf = tmp_path / "regen.yaml"
    conf.write_text("input: {path: in.jsonl}\ngenerate: {output: regen}\n")
    assert main(["run", str(conf)]) == 2
    assert "needs an output section" in capsys.readouterr().err


def test_a_local_ray_starts_with_the_configured_dashboard_and_a_cluster_is_left_its_own(monkeypatch):
    import ray

    from conf import load_config
    from pipeline import cli

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for sets in ([], ["ray.dashboard=false"], ["ray.address=ray://head:10001", "ray.dashboard=false"]):
        cli._init_ray(load_config(str(Path(__file__).parents[3] / "conf" / "default.yaml"), sets))
    assert [c.get("include_dashboard") for c in calls] == [True, False, None]
    assert calls[2]["address"] == "ray://head:10001"


def test_a_minimal_ray_starts_without_the_dashboard_and_says_why(monkeypatch, caplog):
    import sys

    import ray

    from conf import load_config
    from pipeline import cli

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # A Ray without ray[default]: the module Ray checks for its dashboard's dependencies cannot be imported.
    monkeypatch.setitem(sys.modules, "ray.dashboard.optional_deps", None)
    with caplog.at_level("WARNING", logger="harvest"):
        cli._init_ray(load_config(str(Path(__file__).parents[3] / "conf" / "default.yaml"), []))
    assert calls[0]["include_dashboard"] is False
    assert "starting without it" in caplog.text
