"""`init_custom_process_group`: a torch process group apart from the default one, made the way SGLang's
`init_custom_process_group` makes it, so that either end of a weight sync can be SGLang. The trainer (rank 0,
the sender) and the engine (rank >= 1, a receiver) both use it.

This module imports torch: the gateway, which is torch-free, never imports it (tests/test_import_graph.py)."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    GroupName,
    PrefixStore,
    _new_process_group_helper,
    _world,
    rendezvous,
)


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout: timedelta) -> dist.ProcessGroup:
    """A group of `world_size` ranks rendezvoused at `init_method` (`tcp://host:port`), its keys under
    `group_name`. Rank 0 serves the TCP store itself: under torchrun, `rendezvous` would make it a client of the
    launcher's store. The other ranks join it through `rendezvous`, as SGLang's do."""
    if rank == 0:
        host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
        store: dist.Store = dist.TCPStore(host, int(port), world_size, is_master=True, timeout=timeout,
                                          wait_for_workers=False)
    else:
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], backend, store, group_name=GroupName(group_name),
                                    timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg
