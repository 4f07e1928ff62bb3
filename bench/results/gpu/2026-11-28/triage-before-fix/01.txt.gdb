[Thread debugging using libthread_db enabled]
Using host libthread_db library "/lib/x86_64-linux-gnu/libthread_db.so.1".
[Detaching after vfork from child process 1386]
[Detaching after vfork from child process 1387]
[Detaching after vfork from child process 1388]
[Detaching after vfork from child process 1389]
[Detaching after vfork from child process 1390]
[Detaching after vfork from child process 1391]
[Detaching after vfork from child process 1392]
[New Thread 0x7fffd29ff6c0 (LWP 1393)]
[New Thread 0x7fffd21fe6c0 (LWP 1394)]
[New Thread 0x7fffd19fd6c0 (LWP 1395)]
[New Thread 0x7fffd11fc6c0 (LWP 1396)]
[New Thread 0x7fffd09fb6c0 (LWP 1397)]
[New Thread 0x7fffd01fa6c0 (LWP 1398)]
[New Thread 0x7fffcf9f96c0 (LWP 1399)]
[New Thread 0x7fffcf1f86c0 (LWP 1400)]
[New Thread 0x7fffce9f76c0 (LWP 1401)]
[New Thread 0x7fffce1f66c0 (LWP 1402)]
[New Thread 0x7fffcd9f56c0 (LWP 1403)]
[New Thread 0x7fffcd1f46c0 (LWP 1404)]
[New Thread 0x7fffcc9f36c0 (LWP 1405)]
[New Thread 0x7fffcc1f26c0 (LWP 1406)]
[New Thread 0x7fffcb9f16c0 (LWP 1407)]
[New Thread 0x7fff12bff6c0 (LWP 1413)]
[New Thread 0x7fff1192e6c0 (LWP 1414)]
[Thread 0x7fffcb9f16c0 (LWP 1407) exited]
[Thread 0x7fffcc1f26c0 (LWP 1406) exited]
[Thread 0x7fffcc9f36c0 (LWP 1405) exited]
[Thread 0x7fffcd1f46c0 (LWP 1404) exited]
[Thread 0x7fffcd9f56c0 (LWP 1403) exited]
[Thread 0x7fffce1f66c0 (LWP 1402) exited]
[Thread 0x7fffce9f76c0 (LWP 1401) exited]
[Thread 0x7fffcf1f86c0 (LWP 1400) exited]
[Thread 0x7fffcf9f96c0 (LWP 1399) exited]
[Thread 0x7fffd01fa6c0 (LWP 1398) exited]
[Thread 0x7fffd09fb6c0 (LWP 1397) exited]
[Thread 0x7fffd11fc6c0 (LWP 1396) exited]
[Thread 0x7fffd19fd6c0 (LWP 1395) exited]
[Thread 0x7fffd21fe6c0 (LWP 1394) exited]
[Thread 0x7fffd29ff6c0 (LWP 1393) exited]
[Detaching after fork from child process 1415]
[Detaching after vfork from child process 1426]
warning: Cuda Driver error detected: No CUDA context is current to the calling thread
warning: Cuda Driver error detected: Returning 201 (CUDA_ERROR_INVALID_CONTEXT) from cuCtxGetDevice_v2
warning: Cuda Driver error detected: No CUDA context is current to the calling thread
warning: Cuda Driver error detected: Returning 201 (CUDA_ERROR_INVALID_CONTEXT) from cuCtxGetDevice_v2
[New Thread 0x7fffcb9f16c0 (LWP 1427)]

Thread 1 "python" received signal SIGSEGV, Segmentation fault.
0x00007fffd0fb7124 in std::codecvt<char16_t, char, __mbstate_t>::do_unshift(__mbstate_t&, char*, char*, char*&) const () from /work/main/.gpu-venv/lib/python3.12/site-packages/moecomm/_cuda.cpython-312-x86_64-linux-gnu.so
#0  0x00007fffd0fb7124 in std::codecvt<char16_t, char, __mbstate_t>::do_unshift(__mbstate_t&, char*, char*, char*&) const () from /work/main/.gpu-venv/lib/python3.12/site-packages/moecomm/_cuda.cpython-312-x86_64-linux-gnu.so
#1  0x00007fffd100d351 in std::basic_ostream<char, std::char_traits<char> >& std::basic_ostream<char, std::char_traits<char> >::_M_insert<long>(long) () from /work/main/.gpu-venv/lib/python3.12/site-packages/moecomm/_cuda.cpython-312-x86_64-linux-gnu.so
#2  0x00007fffd0f1032c in moecomm::transport::cuda_ipc::DeviceWaitProbe::DeviceWaitProbe(moecomm::transport::cuda_ipc::IpcPeerTable const&, unsigned long, moecomm::transport::WaitPredicate const&, long, unsigned int) () from /work/main/.gpu-venv/lib/python3.12/site-packages/moecomm/_cuda.cpython-312-x86_64-linux-gnu.so
#3  0x00007fffd0e9ea62 in ?? () from /work/main/.gpu-venv/lib/python3.12/site-packages/moecomm/_cuda.cpython-312-x86_64-linux-gnu.so
#4  0x00007fffd0ed085b in ?? () from /work/main/.gpu-venv/lib/python3.12/site-packages/moecomm/_cuda.cpython-312-x86_64-linux-gnu.so
#5  0x00007fffd0ea27db in ?? () from /work/main/.gpu-venv/lib/python3.12/site-packages/moecomm/_cuda.cpython-312-x86_64-linux-gnu.so
#6  0x00007fffd0ec98e1 in ?? () from /work/main/.gpu-venv/lib/python3.12/site-packages/moecomm/_cuda.cpython-312-x86_64-linux-gnu.so
#7  0x0000000000581fed in ?? ()
#8  0x00000000005499b5 in PyObject_Vectorcall ()
#9  0x00000000005d710f in _PyEval_EvalFrameDefault ()
#10 0x000000000054a8ca in _PyObject_Call_Prepend ()
#11 0x00000000005a3778 in ?? ()
#12 0x000000000054907e in _PyObject_MakeTpCall ()
#13 0x00000000005d710f in _PyEval_EvalFrameDefault ()
#14 0x000000000054a8ca in _PyObject_Call_Prepend ()
#15 0x00000000005a3778 in ?? ()
#16 0x000000000054b12c in PyObject_Call ()
#17 0x00000000005db2ee in _PyEval_EvalFrameDefault ()
#18 0x000000000054a8ca in _PyObject_Call_Prepend ()
#19 0x00000000005a3778 in ?? ()
#20 0x000000000054907e in _PyObject_MakeTpCall ()
#21 0x00000000005d710f in _PyEval_EvalFrameDefault ()
#22 0x000000000054a8ca in _PyObject_Call_Prepend ()
#23 0x00000000005a3778 in ?? ()
#24 0x000000000054907e in _PyObject_MakeTpCall ()
#25 0x00000000005d710f in _PyEval_EvalFrameDefault ()
#26 0x000000000054a8ca in _PyObject_Call_Prepend ()
#27 0x00000000005a3778 in ?? ()
#28 0x000000000054907e in _PyObject_MakeTpCall ()
#29 0x00000000005d710f in _PyEval_EvalFrameDefault ()
#30 0x00000000005d55eb in PyEval_EvalCode ()
#31 0x00000000005d33dc in ?? ()
#32 0x0000000000581fed in ?? ()
#33 0x00000000005499b5 in PyObject_Vectorcall ()
#34 0x00000000005d710f in _PyEval_EvalFrameDefault ()
#35 0x00000000006bcf22 in ?? ()
#36 0x00000000006bcb52 in Py_RunMain ()
#37 0x00000000006bc7bd in Py_BytesMain ()
#38 0x00007ffff7c2a1ca in ?? () from /lib/x86_64-linux-gnu/libc.so.6
#39 0x00007ffff7c2a28b in __libc_start_main () from /lib/x86_64-linux-gnu/libc.so.6
