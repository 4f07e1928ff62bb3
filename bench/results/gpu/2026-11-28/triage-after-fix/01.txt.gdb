[Thread debugging using libthread_db enabled]
Using host libthread_db library "/lib/x86_64-linux-gnu/libthread_db.so.1".
[Detaching after vfork from child process 1560]
[Detaching after vfork from child process 1561]
[Detaching after vfork from child process 1562]
[Detaching after vfork from child process 1563]
[Detaching after vfork from child process 1564]
[Detaching after vfork from child process 1565]
[Detaching after vfork from child process 1566]
[New Thread 0x7fffd29ff6c0 (LWP 1567)]
[New Thread 0x7fffd21fe6c0 (LWP 1568)]
[New Thread 0x7fffd19fd6c0 (LWP 1569)]
[New Thread 0x7fffd11fc6c0 (LWP 1570)]
[New Thread 0x7fffd09fb6c0 (LWP 1571)]
[New Thread 0x7fffd01fa6c0 (LWP 1572)]
[New Thread 0x7fffcf9f96c0 (LWP 1573)]
[New Thread 0x7fffcf1f86c0 (LWP 1574)]
[New Thread 0x7fffce9f76c0 (LWP 1575)]
[New Thread 0x7fffce1f66c0 (LWP 1576)]
[New Thread 0x7fffcd9f56c0 (LWP 1577)]
[New Thread 0x7fffcd1f46c0 (LWP 1578)]
[New Thread 0x7fffcc9f36c0 (LWP 1579)]
[New Thread 0x7fffcc1f26c0 (LWP 1580)]
[New Thread 0x7fffcb9f16c0 (LWP 1581)]
[New Thread 0x7fff12bff6c0 (LWP 1587)]
[New Thread 0x7fff1192e6c0 (LWP 1588)]
[Thread 0x7fffcb9f16c0 (LWP 1581) exited]
[Thread 0x7fffcc1f26c0 (LWP 1580) exited]
[Thread 0x7fffcc9f36c0 (LWP 1579) exited]
[Thread 0x7fffcd1f46c0 (LWP 1578) exited]
[Thread 0x7fffcd9f56c0 (LWP 1577) exited]
[Thread 0x7fffce1f66c0 (LWP 1576) exited]
[Thread 0x7fffce9f76c0 (LWP 1575) exited]
[Thread 0x7fffcf1f86c0 (LWP 1574) exited]
[Thread 0x7fffcf9f96c0 (LWP 1573) exited]
[Thread 0x7fffd01fa6c0 (LWP 1572) exited]
[Thread 0x7fffd09fb6c0 (LWP 1571) exited]
[Thread 0x7fffd11fc6c0 (LWP 1570) exited]
[Thread 0x7fffd19fd6c0 (LWP 1569) exited]
[Thread 0x7fffd21fe6c0 (LWP 1568) exited]
[Thread 0x7fffd29ff6c0 (LWP 1567) exited]
[Detaching after fork from child process 1589]
[Detaching after vfork from child process 1600]
warning: Cuda Driver error detected: No CUDA context is current to the calling thread
warning: Cuda Driver error detected: Returning 201 (CUDA_ERROR_INVALID_CONTEXT) from cuCtxGetDevice_v2
warning: Cuda Driver error detected: No CUDA context is current to the calling thread
warning: Cuda Driver error detected: Returning 201 (CUDA_ERROR_INVALID_CONTEXT) from cuCtxGetDevice_v2
[New Thread 0x7fffcb9f16c0 (LWP 1601)]
[Detaching after vfork from child process 1602]
[Detaching after vfork from child process 1603]
.[Detaching after vfork from child process 1621]
.[Detaching after vfork from child process 1639]
.[Detaching after vfork from child process 1657]
..[Detaching after vfork from child process 1675]
[Detaching after vfork from child process 1676]
[Detaching after vfork from child process 1677]
F
=================================== FAILURES ===================================
____________________ test_peers_join_and_leave_at_run_time _____________________
tests/gpu/test_ipc_gpu.py:221: in test_peers_join_and_leave_at_run_time
    assert r["status"] == _C.WaitStatus.OK and r["observed"] == tag
E   AssertionError: assert (<WaitStatus.TIMEOUT: 1> == <WaitStatus.OK: 0>)
E    +  where <WaitStatus.OK: 0> = <class 'moecomm._C.WaitStatus'>.OK
E    +    where <class 'moecomm._C.WaitStatus'> = _C.WaitStatus
=========================== short test summary info ============================
FAILED tests/gpu/test_ipc_gpu.py::test_peers_join_and_leave_at_run_time - Ass...
!!!!!!!!!!!!!!!!!!!!!!!!!! stopping after 1 failures !!!!!!!!!!!!!!!!!!!!!!!!!!!
1 failed, 5 passed in 34.75s
[Thread 0x7fffcb9f16c0 (LWP 1601) exited]
[Thread 0x7fff1192e6c0 (LWP 1588) exited]
[Thread 0x7ffff7e7e140 (LWP 1557) exited]
[Thread 0x7fff12bff6c0 (LWP 1587) exited]
[New process 1557]
[Inferior 1 (process 1557) exited with code 01]
No stack.
