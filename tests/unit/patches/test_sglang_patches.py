import pytest

from patches.sglang import UnsupportedSGLangVersion, installed_sglang_version, server_pythonpath


def test_unsupported_version_names_the_supported_one():
    with pytest.raises(UnsupportedSGLangVersion) as exc:
        server_pythonpath(cpu=True, version="0.5.22")
    message = str(exc.value)
    assert "0.5.22" in message and "0.5.23" in message


@pytest.mark.parametrize("cpu, names", [(True, ["sitedir", "cpu_standin"]), (False, ["sitedir"])])
def test_pinned_version_dirs_exist(cpu, names):
    dirs = server_pythonpath(cpu=cpu, version="0.5.23")
    assert [d.name for d in dirs] == names
    assert all(d.is_dir() for d in dirs)
    assert (dirs[0] / "sitecustomize.py").is_file() and (dirs[0] / "hidden_harvest_hook.py").is_file()


def test_installed_version_is_the_pinned_one(hook_modules):
    # The hook refuses any other version at patch time; the environment must match it.
    assert installed_sglang_version() == hook_modules.hook.PINNED_SGLANG_VERSION == "0.5.23"


def test_the_hook_refuses_another_sglang_version_inside_the_server(hook_modules, monkeypatch):
    monkeypatch.setattr(hook_modules.hook.importlib.metadata, "version", lambda name: "0.5.24")
    with pytest.raises(RuntimeError, match="pinned to sglang==0.5.23, found 0.5.24"):
        hook_modules.hook._check_version()


def test_fault_spec_is_parsed_and_unknown_faults_refused(hook_modules, tmp_path):
    faults = hook_modules.faults.Faults("nan:0.5, missing:1", None, str(tmp_path))
    assert faults.rates == {"nan": 0.5, "missing": 1.0}
    with pytest.raises(ValueError, match="unknown fault 'typo'"):
        hook_modules.faults.Faults("typo:0.1", None, str(tmp_path))
