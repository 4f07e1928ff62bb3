"""The slot wire: how clients and expert servers (or pipeline stages) talk, one module a role.

- protocol.py  the wire format: encodings and their dtypes, signal words, SlotLayout, headers
- transport.py the transport interface every backend implements: Region, Transport, signal/wait ops
- shm.py       the shared-memory transport (one host), and the reaping of dead owners' segments
- nixl.py      the NIXL transport (across hosts), open_nixl_transport()
- cuda.py      the GPU side: is there a device, the CUDA-IPC / NVSHMEM native modules, IPC handles
- choose.py    which transport each peer pair speaks (TransportSet, choose), make_transport()
- views.py     zero-copy torch views of region memory and of a request's parts in a peer's slot
- channel.py   what every slot channel shares: the two slot rings, our region, deadlines, errors
- client.py    the client's end of a request channel (ClientChannel, Response)
- server.py    the server's end of a request channel (ServerChannel, Request)
- stage.py     stage-to-stage channels between pipeline stages (StageSender, StageReceiver, Inbox)
- kv/          KV block transfers between registered pools (KvPool, KvPeer, KvSend, KvRecv)
"""
