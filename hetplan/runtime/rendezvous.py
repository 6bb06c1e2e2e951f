"""Rendezvous of local worker processes over env:// (torch.distributed's environment variables).

`hetplan run` and `hetplan profile` start their workers on this machine and hand each one the
variables torchrun would set, so the same worker function runs under both.
"""
from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it; nothing holds it until rank 0 binds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_vars(rank: int, world: int, addr: str, port: int) -> dict[str, str]:
    """The env:// variables of rank `rank` among `world` processes, all on one node (node rank
    0, local rank = rank), meeting at `addr`:`port`."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "MASTER_ADDR": addr,
            "MASTER_PORT": str(port)}
