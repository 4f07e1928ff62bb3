"""A whole deployment on this machine, as a user runs it with the `moecomm` command: optionally
a membership monitor, N expert servers, front ends of any role, a router in front of the
prefill/decode ones. Every tier starts concurrently; one close() stops all of it (router, front
ends, servers, monitor: callers before callees), reaping every group's shared memory."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from moecomm.testing.procs import MONITOR_CMD, START_TIMEOUT_S, Proc, Processes, wait_all

# Each process gets one torch thread: several share the machine's cores.
ONE_THREAD = ("--threads", "1")
ROLES = (None, "prefill", "decode")


@dataclass(frozen=True)
class FrontendSpec:
    """One `moecomm frontend`: its `role` (None, "prefill" or "decode"), more flags (`args`),
    and its process name (default: frontend-<index>, or <role>-<index>)."""

    role: str | None = None
    args: tuple[str, ...] = ()
    name: str | None = None

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"front-end role must be one of {ROLES}, got {self.role!r}")


@dataclass
class LocalCluster:
    """The processes :func:`start_local_cluster` started, and their URLs."""

    procs: Processes
    checkpoint: str
    monitor: Proc | None = None
    servers: list[Proc] = field(default_factory=list)
    frontends: list[Proc] = field(default_factory=list)
    router: Proc | None = None

    @property
    def monitor_url(self) -> str | None:
        return None if self.monitor is None else self.monitor.url

    @property
    def server_urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def frontend_urls(self) -> list[str]:
        return [f.url for f in self.frontends]

    @property
    def router_url(self) -> str | None:
        return None if self.router is None else self.router.url

    def frontends_of(self, role: str | None) -> list[Proc]:
        """The front ends that announced `role` (their ready file's "pd_role")."""
        return [f for f in self.frontends if f.ready.get("pd_role") == role]

    def close(self) -> dict:
        return self.procs.close()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def server_args(checkpoint: str, experts: str, server_id: str, monitor: str | None) -> list[str]:
    args = ["expert-server", "--checkpoint", checkpoint, "--experts", experts, "--id", server_id]
    return [*args, *(("--monitor", monitor) if monitor else ()), *ONE_THREAD]


def frontend_args(
    checkpoint: str, model_name: str, spec: FrontendSpec, monitor: str | None, servers: list[str]
) -> list[str]:
    args = ["frontend", "--checkpoint", checkpoint, "--model-name", model_name, "--port", "0"]
    if monitor:
        args += ["--monitor", monitor]
    elif servers:
        args += ["--servers", ",".join(servers)]
    else:
        args += ["--local-experts"]
    if spec.role is not None:
        args += ["--role", spec.role]
    return [*args, *ONE_THREAD, *spec.args]


def router_args(
    checkpoint: str, model_name: str, prefill: list[str], decode: list[str], extra=()
) -> list[str]:
    args = ["router", "--checkpoint", checkpoint, "--model-name", model_name, "--port", "0"]
    return [*args, "--prefill", ",".join(prefill), "--decode", ",".join(decode), *extra]


def start_local_cluster(
    checkpoint: str,
    *,
    monitor: bool = False,
    servers: Sequence[str] = (),
    frontends: Sequence[FrontendSpec] = (FrontendSpec(),),
    router: bool | Sequence[str] = False,
    model_name: str = "tiny",
    server_extra: Sequence[str] = (),
    procs: Processes | None = None,
    id_prefix: str = "local",
    timeout: float = START_TIMEOUT_S,
) -> LocalCluster:
    """Starts, each tier concurrently: the monitor (if `monitor`), one expert server per entry of
    `servers` (its --experts, e.g. "all" or "0-7"; registered with the monitor if there is one),
    the `frontends` (finding the servers through the monitor, else by URL, else in-process
    experts when there are no servers), then a router (`router`: True, or its extra flags) over
    the prefill and decode front ends. Everything runs in `procs` (a new Processes if None); on
    any failure what started is stopped before the error propagates."""
    procs = Processes() if procs is None else procs
    cluster = LocalCluster(procs, str(checkpoint))
    ckpt = cluster.checkpoint
    try:
        if monitor:
            cluster.monitor = procs.start("monitor", [*MONITOR_CMD, "--port", "0"], timeout=timeout)
        mon = cluster.monitor_url
        cluster.servers = [
            procs.spawn(
                f"server-{i}",
                [
                    *procs.cli,
                    *server_args(ckpt, experts, f"{id_prefix}-server-{i}", mon),
                    *server_extra,
                ],
            )
            for i, experts in enumerate(servers)
        ]
        wait_all(cluster.servers, timeout)
        urls = cluster.server_urls
        for i, spec in enumerate(frontends):
            name = spec.name or f"{spec.role or 'frontend'}-{i}"
            args = frontend_args(ckpt, model_name, spec, mon, urls)
            cluster.frontends.append(procs.spawn(name, [*procs.cli, *args]))
        wait_all(cluster.frontends, timeout)
        if router:
            extra = () if router is True else tuple(router)
            pairs = list(zip(cluster.frontends, frontends, strict=True))
            by_role = {r: [f.url for f, s in pairs if s.role == r] for r in ("prefill", "decode")}
            if not by_role["prefill"] or not by_role["decode"]:
                raise ValueError("a router needs at least one prefill and one decode front end")
            args = router_args(ckpt, model_name, by_role["prefill"], by_role["decode"], extra)
            cluster.router = procs.spawn("router", [*procs.cli, *args])
            cluster.router.wait_ready(timeout)
    except BaseException:
        procs.close()
        raise
    return cluster
