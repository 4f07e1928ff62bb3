"""DeepEP's ``deep_ep`` module on moecomm: the names DeepEP's ``deep_ep/__init__.py`` exports
(``Buffer``, ``ElasticBuffer``, ``EPHandle``, ``EventOverlap``, ``EventHandle``, ``Config``,
``topk_idx_t``, ``get_physical_domain_size``, ``get_logical_domain_size``) and nothing else, so
that an engine can import this module as ``deep_ep`` (opt-in, ``engines/alias``:
``MOECOMM_AS_DEEP_EP=1``). ``Buffer``'s low-latency API runs over moecomm's slot protocol: CPU
tensors on the host transport (``low_latency/buffer.py``, ``low_latency/host.py``), CUDA
tensors on the device kernels over CUDA IPC (``low_latency/device.py``); its normal mode and
``ElasticBuffer`` on the host transport (``normal/mode.py``, ``elastic.py``).

Same signatures as DeepEP's ``deep_ep.Buffer`` (``deep_ep/buffers/legacy.py``, DeepEP dd758ca):
names, order and defaults, moecomm's own options keyword-only after them. Rank ``r`` hosts
experts ``r*L .. r*L+L-1`` (``L = num_experts / num_ranks``) and owns a request ring
(``ServerChannel``) and a response ring (``ClientChannel``) per peer, itself included.

- **dispatch** (a *round*: seq = round + 1, slot = round % 2): cast with DeepEP's fp8 formula
  (``low_latency/cast.py``), pack one request per rank with :func:`moecomm.ops.pack_dispatch` (each
  token once per destination), write them all, wake every rank. Receive = wait for every rank's
  request of this round and lay the copies out per local expert.
- **combine** (its own counter: answers in slot c % 2 with seq ``COMBINE_SEQ_BASE + c + 1``):
  answer each source rank with the outputs of its copies in its request's (row, k) order; wait
  for our answers and reduce ``out[t] = Σ_k w[t, k] · y(t, k)`` in f32, k ascending.

DeepEP's contract, kept: each dispatch's outputs are its own and need not be combined; a handle
may be combined more than once (e.g. once plainly, once ``zero_copy``); ``recv_x`` and the
combine buffer of a call are reused two calls later (DeepEP's two buffers); every rank makes the
same sequence of calls. Shrink mode masks a rank that does not answer within ``timeout`` and
goes on without it. Differences from DeepEP (docs/compat-deep-ep.md lists them all):

1. **Order inside an expert is deterministic**: source rank major, token index ascending
   (DeepEP: arrival order). ``layout_range`` describes it exactly as in DeepEP.
2. **CPU or CUDA tensors, one kind per Buffer**. On the host, calls complete before they return
   and ``event`` is a :class:`CompletedEvent`. The CUDA path (``low_latency/device.py``, not
   yet run on a GPU) keeps the same contract and flags, but refuses shrink mode and
   ``combine_wait_recv_cost_stats``.
3. ``use_logfmt``: the answers travel as bf16 and the receiver reduces their LogFMT-10
   round trip (``low_latency.cast.logfmt_roundtrip``: DeepEP's formula in exact f32, where
   DeepEP uses approximate lg2/ex2): DeepEP's numerics within its tolerance, not its bits nor
   its bandwidth.
4. Rows past ``recv_count`` are stale; ``src_info`` is -1 there. Cost stats are nanoseconds of
   host wait per source rank (DeepEP: GPU clock cycles).
5. Buffer sizes, QPs and the NVLink/MNNVL flags are accepted and ignored (slots are sized from
   the shape). With ``low_latency_mode=False`` the low-latency methods raise, as DeepEP's
   assert; the normal-mode ones (``get_dispatch_layout``, ``dispatch``, ``combine``: host
   tensors, ``normal/mode.py``) work on every Buffer, as in DeepEP.
6. **Rendezvous**: a ``ProcessGroup`` (one ``all_gather_object``), an mpi4py ``comm``, or the
   keyword-only ``rank``, ``num_ranks`` and ``store``. Set up at construction when the
   keyword-only shape is given, else at the first dispatch. ``num_max_dispatch_tokens_per_rank``,
   ``hidden`` and ``num_experts`` may not change afterwards; the **top-k is per call**, as in
   DeepEP (``topk_idx.shape[1]``): the slots hold the largest top-k seen, and a larger one
   re-sizes them (host path: a rendezvous at that dispatch, with no results in flight; the CUDA
   path refuses it by name).
7. **Every wait has a deadline** (``timeout``): ``moecomm.DeadlineExceededError`` /
   ``moecomm.PeerLostError`` naming the rank, or, with ``enable_shrink``, that rank masked.
8. moecomm extension, opt-in: ``replicas={expert: [ranks]}`` (with shrink) re-routes a masked
   rank's experts to live replicas; local experts become ``local_experts``
   (``low_latency/replicas.py``).
9. Refused by name (``NotImplementedError`` saying why) at the first call:
   ``get_local_buffer_tensor`` (no single registered region), ``get_comm_stream``,
   ``internode_dispatch`` / ``internode_combine``, NVFP4 dispatch (``use_nvfp4`` /
   ``x_global_scale``), the combine's signal overlap (``overlap=True``), and on CUDA tensors
   shrink mode, ``combine_wait_recv_cost_stats``, the normal mode and a top-k above the
   first one's.
"""

from moecomm.compat.api import (
    Config,
    EventHandle,
    EventOverlap,
    get_logical_domain_size,
    get_physical_domain_size,
    topk_idx_t,
)
from moecomm.compat.elastic import ElasticBuffer, EPHandle
from moecomm.compat.low_latency.buffer import Buffer

# Exactly the API names of DeepEP's deep_ep/__init__.py (v2.1.0); no helper is exported.
__all__ = [
    "Buffer",
    "Config",
    "EPHandle",
    "ElasticBuffer",
    "EventHandle",
    "EventOverlap",
    "get_logical_domain_size",
    "get_physical_domain_size",
    "topk_idx_t",
]
