"""The KV byte package: a request's KV cache as one flat byte buffer, for the one hand-off that
cannot go pool to pool yet — a prefill and a decode front end on different hosts, whose KV
pools cannot map each other (the serving's KV pools are shm only);
:mod:`moecomm_serving.disagg.staged` moves the bytes over a stage channel (nixl). On one host
the blocks move pool to pool (:mod:`moecomm_serving.disagg.transfer`) and no package is made.

:func:`pack` gathers a hand-off's held blocks into a :class:`PackedKv` (keys and values as
tensors), :func:`unpack` reserves blocks in the receiving pool and writes them back.

The format is ours and carries data only (no pickle): an 8-byte magic, a u32 little-endian
header length, a UTF-8 JSON header (the export's metadata, the tensors' shapes and the hand-off
id), then the keys' raw bytes and the values' raw bytes. :func:`decode_package` checks every
field and size before it reads a byte of the tensors (never past the buffer) and refuses
anything else with :class:`KvHandoffError`; whether the package fits the receiving pool is
:func:`~moecomm_serving.kv.blocks.check_package`'s question (asked by :func:`unpack`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import warnings
from dataclasses import dataclass

import torch
from moecomm.errors import MoecommError

from moecomm_serving.kv.blocks import EXPORT_VERSION, BlockPool, HeldBlocks
from moecomm_serving.types import KvPackage

# The package format: the magic names it and its revision (a new layout gets a new magic).
PACKAGE_MAGIC = b"MCKVPKG1"
_PREFIX = struct.Struct("<8sI")  # magic, header length
# The JSON header holds a few numbers and lists (a layer list of a few hundred ids at most);
# anything larger is not a header of ours and is refused before it is parsed.
MAX_HEADER_BYTES = 1 << 20
# The header's keys: the package's metadata (KvPackage.meta), the tensors' shapes, and the
# hand-off's id.
HEADER_KEYS = frozenset(
    {f.name for f in dataclasses.fields(KvPackage)} | {"handoff_id", "k_shape", "v_shape"}
)
# Element types a KV pool may hold (the names KvPackage.dtype takes).
KV_DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2")
    if hasattr(torch, name)
}


@dataclass(frozen=True)
class PackedKv:
    """A cache's metadata (:class:`~moecomm_serving.types.KvPackage`'s fields) with its keys and
    values on the CPU, ``[layers, blocks, heads, block_tokens, width]``, blocks in the block
    table's order."""

    version: int
    length: int
    block_tokens: int
    layers: tuple[int, ...]
    kv_shape: tuple[int, int, int]
    dtype: str
    k: torch.Tensor
    v: torch.Tensor

    @property
    def package(self) -> KvPackage:
        return KvPackage(**self.meta())

    def meta(self) -> dict:
        return {
            "version": self.version,
            "length": self.length,
            "block_tokens": self.block_tokens,
            "layers": list(self.layers),
            "kv_shape": list(self.kv_shape),
            "dtype": self.dtype,
        }


def pack(held: HeldBlocks) -> PackedKv:
    """`held`'s blocks gathered into a :class:`PackedKv` (copies: the blocks stay held)."""
    pool, p = held.pool, held.package
    idx = torch.tensor(held.blocks, dtype=torch.int64, device=pool.device)
    layers = pool.layers
    return PackedKv(
        p.version,
        p.length,
        p.block_tokens,
        tuple(p.layers),
        tuple(p.kv_shape),
        p.dtype,
        torch.stack([pool.k[i].index_select(0, idx) for i in layers]).cpu(),
        torch.stack([pool.v[i].index_select(0, idx) for i in layers]).cpu(),
    )


def unpack(pool: BlockPool, packed: PackedKv) -> HeldBlocks:
    """Blocks of `pool` reserved for `packed` (its metadata checked against the pool:
    ValueError when it does not fit) and written with its keys and values."""
    if not isinstance(packed, PackedKv):
        raise ValueError(f"a packed KV cache is a PackedKv, got {type(packed).__name__}")
    heads, kd, vd = pool.kv_shape
    nb = pool.blocks_for(packed.length)
    want = {
        "k": (len(pool.layers), nb, heads, pool.block_tokens, kd),
        "v": (len(pool.layers), nb, heads, pool.block_tokens, vd),
    }
    held = HeldBlocks.reserve(pool, packed.package)
    try:
        for name, shape in want.items():
            t = getattr(packed, name)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != pool.dtype:
                got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t)
                raise ValueError(
                    f"KV package {name} must be a {pool.dtype} tensor of shape {shape}, got {got}"
                )
        idx = torch.tensor(held.blocks, dtype=torch.int64, device=pool.device)
        for li, layer in enumerate(pool.layers):
            pool.k[layer].index_copy_(0, idx, packed.k[li].to(pool.device))
            pool.v[layer].index_copy_(0, idx, packed.v[li].to(pool.device))
    except BaseException:
        held.release()
        raise
    return held


class KvHandoffError(MoecommError, ValueError):
    """A KV package or hand-off request that is malformed or does not match (wrong magic,
    truncated, inconsistent sizes, another hand-off's id, a transport not offered); HTTP 400."""


def _positive_int(v, what: str, minimum: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise KvHandoffError(f"KV package header: {what} must be an int >= {minimum}, got {v!r}")
    return v


def _int_list(v, what: str, length: int | None = None, minimum: int = 0) -> list[int]:
    if not isinstance(v, list) or (length is not None and len(v) != length):
        want = f"a list of {length} ints" if length is not None else "a list of ints"
        raise KvHandoffError(f"KV package header: {what} must be {want}, got {v!r:.200}")
    return [_positive_int(x, f"each of {what}", minimum) for x in v]


def _check_meta(meta: dict) -> tuple[torch.dtype, tuple[int, ...], tuple[int, ...]]:
    """The package's dtype and the shapes its keys and values must have, from its metadata
    (:meth:`KvPackage.meta`'s fields); raises KvHandoffError on anything malformed."""
    version = _positive_int(meta["version"], "version")
    if version != EXPORT_VERSION:
        raise KvHandoffError(f"KV package version {version}, this build reads {EXPORT_VERSION}")
    length = _positive_int(meta["length"], "length")
    block_tokens = _positive_int(meta["block_tokens"], "block_tokens", 1)
    layers = _int_list(meta["layers"], "layers")
    if not layers or len(set(layers)) != len(layers):
        raise KvHandoffError(f"KV package layers must be distinct and not empty, got {layers}")
    heads, kd, vd = _int_list(meta["kv_shape"], "kv_shape", 3, 1)
    dtype_name = meta["dtype"]
    if not isinstance(dtype_name, str) or dtype_name not in KV_DTYPES:
        raise KvHandoffError(
            f"KV package dtype {dtype_name!r:.60} is not one of {', '.join(KV_DTYPES)}"
        )
    blocks = -(-length // block_tokens)
    k_shape = (len(layers), blocks, heads, block_tokens, kd)
    v_shape = (len(layers), blocks, heads, block_tokens, vd)
    return KV_DTYPES[dtype_name], k_shape, v_shape


def encode_package(package: PackedKv, handoff_id: str) -> torch.Tensor:
    """`package` as one uint8 CPU tensor in our format."""
    if not isinstance(handoff_id, str):
        raise KvHandoffError(f"handoff_id must be a str, got {type(handoff_id).__name__}")
    if not isinstance(package, PackedKv):
        raise KvHandoffError(f"a KV package is a PackedKv, got {type(package).__name__}")
    meta = package.meta()
    dtype, k_shape, v_shape = _check_meta(meta)
    tensors = []
    for name, shape in (("k", k_shape), ("v", v_shape)):
        t = getattr(package, name)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
            got = (list(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
            raise KvHandoffError(
                f"KV package {name} must be a {dtype} tensor of shape {list(shape)}, got {got}"
            )
        tensors.append(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8))
    header = {**meta, "handoff_id": handoff_id, "k_shape": list(k_shape), "v_shape": list(v_shape)}
    head = json.dumps(header, separators=(",", ":")).encode()
    if len(head) > MAX_HEADER_BYTES:
        raise KvHandoffError(f"KV package header of {len(head)} bytes exceeds {MAX_HEADER_BYTES}")
    k, v = tensors
    out = torch.empty(_PREFIX.size + len(head) + k.numel() + v.numel(), dtype=torch.uint8)
    start = _PREFIX.size + len(head)
    prefix = _PREFIX.pack(PACKAGE_MAGIC, len(head)) + head
    out[:start] = torch.frombuffer(bytearray(prefix), dtype=torch.uint8)
    out[start : start + k.numel()] = k
    out[start + k.numel() :] = v
    return out


def _as_bytes_tensor(data) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise TypeError(
                f"a KV package is a 1-D uint8 tensor, got {data.dtype} {list(data.shape)}"
            )
        return data.cpu().contiguous()
    if isinstance(data, bytes | bytearray | memoryview):
        if len(data) == 0:
            return torch.empty(0, dtype=torch.uint8)
        with warnings.catch_warnings():  # read-only bytes: only copies are taken from it
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(data, dtype=torch.uint8)
    raise TypeError(f"a KV package is a uint8 tensor or bytes, got {type(data).__name__}")


def decode_package(data: torch.Tensor | bytes, handoff_id: str | None = None) -> PackedKv:
    """The :class:`PackedKv` held by `data` (k and v in their own memory). Raises
    KvHandoffError for anything malformed, and for another hand-off's package when `handoff_id`
    is given. Whether it fits a pool is :func:`unpack`'s check."""
    buf = _as_bytes_tensor(data)
    n = buf.numel()
    if n < _PREFIX.size:
        raise KvHandoffError(f"KV package truncated: {n} bytes, its prefix alone is {_PREFIX.size}")
    magic, hlen = _PREFIX.unpack(bytes(buf[: _PREFIX.size].tolist()))
    if magic != PACKAGE_MAGIC:
        raise KvHandoffError(f"not a KV package: magic {magic!r}, expected {PACKAGE_MAGIC!r}")
    if hlen > MAX_HEADER_BYTES or _PREFIX.size + hlen > n:
        raise KvHandoffError(
            f"KV package truncated or corrupt: header of {hlen} bytes, {n - _PREFIX.size} "
            "bytes follow the prefix"
        )
    raw = bytes(buf[_PREFIX.size : _PREFIX.size + hlen].numpy())
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KvHandoffError(f"KV package header is not UTF-8 JSON: {e}") from None
    if not isinstance(header, dict) or set(header) != HEADER_KEYS:
        got = sorted(header) if isinstance(header, dict) else type(header).__name__
        raise KvHandoffError(
            f"KV package header has exactly the keys {sorted(HEADER_KEYS)}, got {got}"
        )
    if not isinstance(header["handoff_id"], str):
        raise KvHandoffError(
            f"KV package handoff_id must be a str, got {header['handoff_id']!r:.80}"
        )
    if handoff_id is not None and header["handoff_id"] != handoff_id:
        raise KvHandoffError(
            f"KV package is hand-off {header['handoff_id']!r:.80}, expected {handoff_id!r:.80}"
        )
    dtype, k_shape, v_shape = _check_meta(header)
    for name, shape in (("k_shape", k_shape), ("v_shape", v_shape)):
        got = _int_list(header[name], name, 5)
        if tuple(got) != shape:
            raise KvHandoffError(
                f"KV package {name} is {got}, its length, layers and kv_shape make {list(shape)}"
            )
    elem = torch.empty((), dtype=dtype).element_size()
    k_bytes, v_bytes = math.prod(k_shape) * elem, math.prod(v_shape) * elem
    start = _PREFIX.size + hlen
    if start + k_bytes + v_bytes != n:
        raise KvHandoffError(
            f"KV package sizes do not add up: header says {k_bytes} + {v_bytes} bytes of keys "
            f"and values, {n - start} follow the header"
        )
    k = buf[start : start + k_bytes].clone().view(dtype).view(k_shape)
    v = buf[start + k_bytes :].clone().view(dtype).view(v_shape)
    return PackedKv(
        version=header["version"],
        length=header["length"],
        block_tokens=header["block_tokens"],
        layers=tuple(header["layers"]),
        kv_shape=tuple(header["kv_shape"]),
        dtype=header["dtype"],
        k=k,
        v=v,
    )
