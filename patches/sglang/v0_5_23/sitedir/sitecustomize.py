"""Runs at start-up of every interpreter whose PYTHONPATH holds this directory.

Only hidden-harvest puts this directory on a PYTHONPATH: the SGLang server it launches and the
scheduler/detokenizer processes SGLang spawns from it (spawned children inherit PYTHONPATH).
It does nothing unless HIDDEN_HARVEST_DUMP_DIR is set, so a stray interpreter is untouched.
"""

import os

if os.environ.get("HIDDEN_HARVEST_DUMP_DIR"):
    import hidden_harvest_hook

    hidden_harvest_hook.install_import_hook()
