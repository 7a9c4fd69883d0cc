"""The house holds: its layers (pyproject.toml [tool.importlinter], ARCHITECTURE.md), checked by import-linter
over every import of the project's packages, direct or indirect, including imports inside functions; and
the formatter and linter configured beside them."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SITEDIR = REPO / "patches" / "sglang" / "v0_5_23" / "sitedir"


def test_the_import_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run(
        [str(lint), "--config", "pyproject.toml"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_the_code_inside_the_sglang_server_imports_nothing_of_the_project():
    """It runs in SGLang's processes, on a PYTHONPATH of its own (not a package import-linter sees)."""
    project = {"pipeline", "actors", "conf", "patches", "bench"}
    for path in SITEDIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            assert not {n.split(".")[0] for n in names} & project, (path.name, names)


def test_the_code_is_formatted_and_linted_as_pyproject_says():
    """ruff's formatter and linter (pyproject.toml [tool.ruff]) hold for every file, so a change that drifts
    from them fails here rather than in review."""
    ruff = Path(sys.executable).with_name("ruff")
    for args in (["check", "."], ["format", "--check", "."]):
        proc = subprocess.run([str(ruff), *args], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"ruff {' '.join(args)}:\n{proc.stdout[-3000:]}{proc.stderr[-1000:]}"
