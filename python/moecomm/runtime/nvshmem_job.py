"""NVSHMEM bootstrap through moecomm's control plane: the unique id and the PE ranks.

NVSHMEM needs a fixed set of PEs that initialise together (docs/gpu-transports.md, "How moecomm
lives with a fixed job"). moecomm has no MPI launcher and no static process group, so the set is
formed over HTTP: one expert server creates the job (``moecomm expert-server --device cuda
--nvshmem-job N``): it draws the unique id (``nvshmemx_get_uniqueid``) and is PE 0; every other
process of the job (servers, attention clients) asks it for a rank with ``POST /nvshmem/join``
(token-checked like ``/connect``), then all of them call ``nvshmem init`` with (id, rank, N),
which returns once the N PEs are in. A member that asks again gets the same rank (a retry after
a lost answer); the N+1st is refused; ``GET /nvshmem`` says how many have joined.

What this does not do (yet): carry the runtime's data path over the job. The GPU server and the
DeviceClient speak CUDA IPC within a node; NVSHMEM's kernels and peer tables are bound
(``moecomm._nvshmem``) and tested by the 2-PE test (tests/gpu/test_nvshmem_gpu.py).
"""

from __future__ import annotations

import threading

from moecomm.errors import MoecommError

__all__ = ["NvshmemJob", "join_job"]

# Members a job may hold: NVSHMEM's own practical bound is far higher; this one keeps a bad
# request from asking for an absurd job.
MAX_JOB_PES = 4096
MAX_MEMBER_ID = 128


class NvshmemJob:
    """The PE set of one NVSHMEM job: PE 0 is the creator, the others join by member id."""

    def __init__(self, nranks: int, unique_id: bytes, creator: str = "creator"):
        if not 1 <= nranks <= MAX_JOB_PES:
            raise ValueError(f"an NVSHMEM job has 1..{MAX_JOB_PES} PEs, got {nranks}")
        if not isinstance(unique_id, bytes | bytearray) or not unique_id:
            raise ValueError("the unique id is the bytes nvshmemx_get_uniqueid wrote")
        self.nranks = nranks
        self.unique_id = bytes(unique_id)
        self._ranks: dict[str, int] = {creator: 0}
        self._lock = threading.Lock()

    @classmethod
    def create(cls, nranks: int, creator: str = "creator") -> NvshmemJob:
        """A new job whose unique id NVSHMEM draws here (needs a GPU and moecomm._nvshmem)."""
        import moecomm.wire.cuda

        return cls(nranks, bytes(moecomm.wire.cuda.nvshmem_module().get_unique_id()), creator)

    def join(self, member_id: str) -> dict:
        """The rank of ``member_id`` (the same one when it asks again); raises when full."""
        if not member_id or len(member_id) > MAX_MEMBER_ID:
            raise ValueError(f"member id must be 1..{MAX_MEMBER_ID} characters")
        with self._lock:
            rank = self._ranks.get(member_id)
            if rank is None:
                if len(self._ranks) >= self.nranks:
                    raise MoecommError(
                        f"the NVSHMEM job is full ({self.nranks} PEs): NVSHMEM cannot grow a job; "
                        "start a new one for more PEs"
                    )
                rank = len(self._ranks)
                self._ranks[member_id] = rank
        return {"unique_id": self.unique_id.hex(), "rank": rank, "nranks": self.nranks}

    def describe(self) -> dict:
        with self._lock:
            return {"nranks": self.nranks, "joined": len(self._ranks)}


def join_job(url: str, member_id: str, token: str = "", timeout: float = 10.0) -> dict:
    """Asks the job's creator at ``url`` for a rank: {"unique_id": bytes, "rank", "nranks"}.
    The caller then runs ``moecomm._nvshmem.init(unique_id, rank, nranks, device)``."""
    import httpx

    try:
        r = httpx.post(
            f"{url}/nvshmem/join", json={"member_id": member_id, "token": token}, timeout=timeout
        )
    except httpx.HTTPError as exc:
        raise ConnectionError(f"{url}/nvshmem/join failed: {exc}") from exc
    if r.status_code != 200:
        raise ConnectionError(f"{url}/nvshmem/join refused ({r.status_code}): {r.text}")
    body = r.json()
    try:
        uid = bytes.fromhex(body["unique_id"])
        rank, nranks = int(body["rank"]), int(body["nranks"])
    except (KeyError, TypeError, ValueError) as exc:
        raise MoecommError(f"{url}: malformed /nvshmem/join answer: {body!r:.200}") from exc
    if not 0 <= rank < nranks:
        raise MoecommError(f"{url}: rank {rank} outside the job's {nranks} PEs")
    return {"unique_id": uid, "rank": rank, "nranks": nranks}
