"""Where a process's MoE layers find their experts when they run on expert servers: the servers
by URL, or the ones registered with a membership monitor (followed as they join and leave).
:func:`connect_experts` gives a connected experts backend (the one dispatch/combine seam,
:class:`moecomm.runtime.ExpertsBackend`): an :class:`moecomm.runtime.AttentionClient` on the host
path, a :class:`moecomm.runtime.DeviceClient` behind :class:`DeviceExperts` with ``device="cuda"``
— the front end has one, and every pipeline stage process its own."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch
from moecomm.errors import MoecommError
from moecomm.membership import connect_membership, monitor_token
from moecomm.runtime import AttentionClient
from moecomm.runtime.launch import SERVING_TTL_S

# Per-request deadline of an expert round trip by default, as `moecomm frontend --timeout`.
DEFAULT_EXPERT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class RemoteExperts:
    """Picklable: how to reach the expert servers (exactly one of `servers` and `monitor`)."""

    servers: tuple[str, ...] = ()
    monitor: str | None = None
    token: str = ""  # of the expert servers' control planes
    timeout: float = DEFAULT_EXPERT_TIMEOUT_S
    encoding: str = "f32"
    ttl: float = SERVING_TTL_S
    transport: str = "shm"  # shm, nixl or auto (moecomm.wire.choose)
    host: str | None = None  # this process's address on the servers' network (nixl)
    device: str = "cpu"  # "cuda[:N]": GPU expert servers through a DeviceClient (CUDA IPC)

    def __post_init__(self):
        if bool(self.servers) == bool(self.monitor):
            raise ValueError("give expert servers either by URL or through a monitor, not both")


class NoExpertServersError(MoecommError, RuntimeError):
    """The membership monitor given knows no expert server to connect to."""


def remote_from_args(args: argparse.Namespace) -> RemoteExperts:
    """The expert servers `moecomm frontend`'s options name (--servers or --monitor)."""
    urls = [] if args.monitor else args.servers.split(",")
    return RemoteExperts(
        servers=tuple(u.strip() for u in urls if u.strip()),
        monitor=args.monitor,
        token=args.token,
        timeout=args.timeout,
        encoding=args.encoding,
        ttl=args.ttl,
        transport=args.transport,
        host=args.host,
        device=getattr(args, "device", "cpu"),
    )


def server_urls(membership) -> list[str]:
    """Control URLs of the servers registered with `membership` that are not draining."""
    return [
        m.endpoints["control"]
        for m in membership.list_members("server")
        if "control" in m.endpoints and m.metadata.get("draining") != "1"
    ]


def connect_experts(
    remote: RemoteExperts,
    hidden: int,
    topk: int,
    max_tokens: int,
    client_id: int | None = None,
    out_dtype: torch.dtype = torch.float32,
    say: Callable[[str], None] | None = None,
):
    """A connected client of the servers `remote` names; on the host path it follows the
    monitor when given (the GPU path takes the servers registered at start). The membership
    monitor's token comes from the environment, as for every CLI process. `say`, when given,
    is told what is being connected (a command's progress lines)."""
    membership = None
    if remote.monitor:
        membership = connect_membership(remote.monitor, monitor_token())
        urls = server_urls(membership)
        if not urls:
            raise NoExpertServersError(f"no expert server is registered with {remote.monitor}")
    else:
        urls = list(remote.servers)
    if remote.device.startswith("cuda"):
        from moecomm.runtime.device_client import DeviceClient

        from moecomm_serving.model.device_experts import DeviceExperts

        device_client = DeviceClient.from_servers(
            urls, device=remote.device, client_id=client_id, timeout=remote.timeout,
            token=remote.token,
        )  # fmt: skip
        if say is not None:
            say(f"connected to {len(urls)} GPU expert server(s) over CUDA IPC")
        return DeviceExperts(device_client)
    client = AttentionClient(
        urls,
        client_id,
        hidden,
        topk,
        max_tokens,
        encoding=remote.encoding,
        out_dtype=out_dtype,
        token=remote.token,
        timeout=remote.timeout,
        transport=remote.transport,
        host=remote.host,
    )
    if say is not None:
        say(f"connecting to {len(urls)} expert server(s) as client {client.client_id}")
    try:
        client.connect()
        if membership is not None:
            client.follow(membership, remote.ttl)
    except BaseException:
        client.close()
        raise
    return client
