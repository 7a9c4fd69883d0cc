"""Runs at start-up of every interpreter whose PYTHONPATH holds this directory.

Only hidden-harvest puts this directory on a PYTHONPATH: the SGLang server it launches and the
scheduler/detokenizer processes SGLang spawns from it (spawned children inherit PYTHONPATH).
Nothing happens unless hidden-harvest's variables are set, so a stray interpreter is untouched:
- HIDDEN_HARVEST_PARENT_PID: in the server's main process (its process-group leader), a watchdog
  that ends the server's process group when the process that started it is gone. It lives in the
  server, not in the starter, so any thread of the starter may start or restart a server.
- HIDDEN_HARVEST_DUMP_DIR: installs the dump hook (hidden_harvest_hook.py).
- HIDDEN_HARVEST_LOOPBACK: keeps torch.distributed's rendezvous store on 127.0.0.1 (hidden_harvest_loopback.py).
"""

import os

if os.environ.get("HIDDEN_HARVEST_PARENT_PID") and os.getpgid(0) == os.getpid():
    import hidden_harvest_watchdog

    hidden_harvest_watchdog.start(int(os.environ["HIDDEN_HARVEST_PARENT_PID"]))

if os.environ.get("HIDDEN_HARVEST_DUMP_DIR"):
    import hidden_harvest_hook

    hidden_harvest_hook.install_import_hook()

if os.environ.get("HIDDEN_HARVEST_LOOPBACK"):
    import hidden_harvest_loopback

    hidden_harvest_loopback.install_import_hook()
