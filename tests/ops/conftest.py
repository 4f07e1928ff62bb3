"""Shared set-up of the ops tests.

The Triton interpreter must be chosen before triton is first imported. Without a device it is
the only way the kernels run, so it is set here, at collection time, for every test in this
folder; on a machine whose torch sees a CUDA device tests/conftest.py has already set
``TRITON_INTERPRET=0`` (the kernels compiled for real), which this ``setdefault`` keeps.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
