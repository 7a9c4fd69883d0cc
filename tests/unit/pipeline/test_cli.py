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
