"""Shared set-up of the ops tests.

The Triton interpreter must be chosen before triton is first imported, so it is set here, at
collection time, for every test in this folder (on a GPU machine, unset it to run the kernels
for real: ``TRITON_INTERPRET=0``).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
