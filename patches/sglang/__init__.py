"""The SGLang dump hook, pinned per SGLang version (see patches/README.md)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

# One directory per supported SGLang version: sitedir/ (the hook) goes on the server's PYTHONPATH,
# cpu_standin/ (an ``sgl_kernel`` stand-in) too, but only in CPU mode: on GPUs the real kernels run.
_VERSION_DIRS = {"0.5.23": Path(__file__).parent / "v0_5_23"}


class UnsupportedSGLangVersion(RuntimeError):
    pass


def installed_sglang_version() -> str:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError as e:
        raise UnsupportedSGLangVersion(
            "sglang is not installed; run `make install` (it installs the pinned CPU/GPU set)"
        ) from e


def server_pythonpath(cpu: bool, version: str | None = None) -> list[Path]:
    """Directories to prepend to the SGLang server's PYTHONPATH; refuses unpinned versions."""
    version = version or installed_sglang_version()
    try:
        root = _VERSION_DIRS[version]
    except KeyError:
        raise UnsupportedSGLangVersion(
            f"the hidden-state hook supports sglang {sorted(_VERSION_DIRS)}, but {version} is installed; "
            "install a supported version or port patches/sglang/ (see patches/README.md)"
        ) from None
    return [root / "sitedir", root / "cpu_standin"] if cpu else [root / "sitedir"]
