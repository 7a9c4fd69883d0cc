"""Keeps torch.distributed's rendezvous store of an SGLang server on the loopback interface.

SGLang initializes torch.distributed with `tcp://127.0.0.1:<port>` even for one process; rank 0 then hosts a
TCPStore, and torch's store server binds every interface (`::`) whatever host it is given, so the server
would accept connections from the network on that port. When the rendezvous host is a loopback address,
this binds the listening socket to that address itself and hands it to the store (`master_listen_fd`).
Independent of the SGLang version: it touches only torch.distributed.rendezvous, after it is imported.
"""

from __future__ import annotations

import logging
import socket
import sys

from hidden_harvest_imports import patch_after_import

logger = logging.getLogger("hidden_harvest.loopback")

_TARGET_MODULE = "torch.distributed.rendezvous"
_LOOPBACK = {"127.0.0.1": socket.AF_INET, "localhost": socket.AF_INET, "::1": socket.AF_INET6}


def _patch(module) -> None:
    original = module._create_c10d_store
    if getattr(original, "_hidden_harvest", False):
        return
    agent_serves = getattr(module, "_agent_store_serves", lambda host, port: False)

    def create_c10d_store(hostname, port, rank, world_size, timeout, use_libuv=True):
        if hostname not in _LOOPBACK or rank != 0 or agent_serves(hostname, port):
            return original(hostname, port, rank, world_size, timeout, use_libuv)
        family = _LOOPBACK[hostname]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("::1" if family == socket.AF_INET6 else "127.0.0.1", port))
        sock.listen(512)
        # detach(): the store owns the descriptor from here on.
        return module.TCPStore(
            host_name=hostname,
            port=port,
            world_size=world_size,
            is_master=True,
            timeout=timeout,
            multi_tenant=True,
            master_listen_fd=sock.detach(),
            use_libuv=use_libuv,
        )

    create_c10d_store._hidden_harvest = True
    module._create_c10d_store = create_c10d_store


def install_import_hook() -> None:
    if _TARGET_MODULE in sys.modules:
        _patch(sys.modules[_TARGET_MODULE])
    else:
        patch_after_import(_TARGET_MODULE, _patch)
