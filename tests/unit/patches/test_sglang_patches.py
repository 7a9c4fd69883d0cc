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


def test_installed_version_is_the_pinned_one(dump_hook):
    # The hook refuses any other version at patch time; the environment must match it.
    assert installed_sglang_version() == dump_hook.PINNED_SGLANG_VERSION == "0.5.23"
