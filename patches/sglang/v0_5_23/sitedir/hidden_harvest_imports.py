"""Run a patch on a module right after it is first imported, in whichever process imports it.

Shared by the server-side patches (hidden_harvest_hook.py, hidden_harvest_loopback.py): each names its
target module and a function that patches it. Nothing is imported early; a process that never imports
the target is never touched.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable


class PatchAfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, target: str, patch: Callable) -> None:
        self.target = target
        self.patch = patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.target:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            self.patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def patch_after_import(target: str, patch: Callable) -> None:
    """Install the finder for `target` once (a second call for the same target does nothing)."""
    if not any(isinstance(f, PatchAfterImport) and f.target == target for f in sys.meta_path):
        sys.meta_path.insert(0, PatchAfterImport(target, patch))
