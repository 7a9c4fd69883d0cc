"""pipeline/envs.py lists every environment variable the project reads, and the code reads them through it."""

import re
from pathlib import Path

from pipeline import envs

ROOT = Path(__file__).resolve().parents[2]
OURS = re.compile(r"\bHIDDEN_HARVEST_[A-Z_]+\b")
# Code that reads the environment; the hook under patches/ cannot import the project, so it names variables itself.
LIBRARY = ("actors", "pipeline", "conf")
SEARCHED = (*LIBRARY, "patches", "bench", "notebooks", "scripts", "tests")


def _files(roots):
    for root in roots:
        for path in sorted((ROOT / root).rglob("*")):
            if path.suffix in (".py", ".ipynb", ".sh") and path.is_file() and path != Path(envs.__file__):
                yield path


def _names_in(roots) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in _files(roots):
        for name in set(OURS.findall(path.read_text(errors="replace"))):
            found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def test_every_project_variable_in_the_code_is_listed():
    listed = {v.name for v in envs.ALL} | set(envs.RETIRED)
    unlisted = {name: where for name, where in _names_in(SEARCHED).items() if name not in listed}
    assert not unlisted, f"add these to pipeline/envs.py (who reads them, who they are for): {unlisted}"


def test_every_listed_variable_is_read_somewhere():
    # A variable nothing reads any more is a stale knob users would still set.
    found = _names_in((*LIBRARY, "patches", "notebooks"))
    ours = [v.name for v in envs.ALL if v.name.startswith("HIDDEN_HARVEST_")]
    assert ours and not [n for n in ours if n not in found and not _read_through_module(n)]


def _read_through_module(name: str) -> bool:
    const = next(k for k, v in vars(envs).items() if isinstance(v, envs.EnvVar) and v.name == name)
    pattern = re.compile(rf"\benvs\.{const}\b")
    return any(pattern.search(p.read_text()) for p in _files(LIBRARY))


def test_library_code_names_no_project_variable_itself():
    # Only the hook (patches/, which imports nothing of the project) spells our names; the library goes through
    # pipeline/envs.py, so the list cannot drift from what is read.
    assert not _names_in(LIBRARY)


def test_retired_names_are_read_nowhere():
    found = _names_in(LIBRARY + ("patches",))
    assert not set(envs.RETIRED) & set(found)
    assert not set(envs.RETIRED) & {v.name for v in envs.ALL}


def test_entries_are_unique_and_documented():
    names = [v.name for v in envs.ALL]
    assert len(names) == len(set(names))
    assert all(v.doc.strip() and v.audience in ("user", "server", "test", "third-party") for v in envs.ALL)
