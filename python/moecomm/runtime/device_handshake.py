"""The handshake of the GPU path: what a device client and a GPU expert server exchange.

``cuda_ipc`` (processes on one node): GET /transports tells the client the server speaks
cuda_ipc, on which node (boot id) and with which slot layout; POST /connect carries the client's
region handle (``cuda_ipc:1:<boot id>:<pid>:<start>:<GPU UUID>:<bytes>:<IPC handle>``) and where
the server's response ring lives in that region; the answer carries the server's region handle
and where the client's request ring lives in it. Both sides then map the other's region
(``IpcPeerTable.add_peer``: refuses another node, a dead owner, GPUs without peer access or
native peer atomics) and the kernels write into it directly.

Refused with a clear error before any slot exists: a host client (shm, nixl) at a GPU server and
a device client at a host server (slots in host memory on one side, GPU memory on the other;
nothing converts), a server on another node (CUDA IPC is node-local), a layout that differs from
the one the GPU server was started with.

``nvshmem`` (across nodes) is bootstrapped through the control plane too, see
:func:`nvshmem_bootstrap`; its fixed PE set is why the runtime's membership does not drive it.
"""

from __future__ import annotations

from moecomm.errors import MoecommError
from moecomm.runtime.control import HTTP_TIMEOUT_S, http_connect, http_transports
from moecomm.wire.choose import boot_id
from moecomm.wire.protocol import SlotLayout

__all__ = ["check_device_offer", "connect_device"]

# Fields of a cuda_ipc connect answer and their types: checked before any of them is used.
_ANSWER_FIELDS = {
    "server_id": str,
    "server_handle": str,
    "request_ring_offset": int,
    "hosted": dict,
    "session": str,
}


def check_device_offer(url: str, offer: dict, layout: SlotLayout, num_slots: int) -> None:
    """Raises, naming the reason, unless the server behind ``offer`` (its GET /transports) can
    serve a device client of ``layout`` on this node."""
    served = offer.get("transports")
    if not isinstance(served, list) or "cuda_ipc" not in served:
        raise MoecommError(
            f"{url} serves over {served}: a device client needs an expert server started with "
            "--device cuda (host clients and GPU servers do not mix: their slots live in "
            "different memories)"
        )
    if offer.get("boot_id") != boot_id():
        raise MoecommError(
            f"{url} runs on another node (boot id {offer.get('boot_id')!r}): CUDA IPC works "
            "within one node only"
        )
    want = offer.get("layout")
    if want is not None and want != layout.to_dict():
        raise MoecommError(
            f"{url} serves the slot layout {want}; this client has {layout.to_dict()}"
        )
    if offer.get("num_slots") not in (None, num_slots):
        raise MoecommError(f"{url} serves {offer.get('num_slots')} slots, this client {num_slots}")


def connect_device(client, url: str, response_ring_offset: int) -> dict:
    """The client half of the cuda_ipc handshake for ``client`` (a DeviceClient); returns the
    checked answer."""
    timeout = max(client.timeout, HTTP_TIMEOUT_S)
    num_slots = len(client.workspaces)
    check_device_offer(url, http_transports(url, timeout), client.layout, num_slots)
    answer = http_connect(
        url,
        client.client_id,
        client.region.handle,
        client.layout,
        num_slots,
        token=client.token,
        timeout=timeout,
        transport="cuda_ipc",
        extra={"response_ring_offset": int(response_ring_offset)},
    )
    for name, kind in _ANSWER_FIELDS.items():
        if not isinstance(answer.get(name), kind):
            raise MoecommError(f"{url}: malformed connect answer, field {name!r}: {answer}")
    if answer["request_ring_offset"] < 0:
        raise MoecommError(f"{url}: negative request_ring_offset in the connect answer")
    return answer
