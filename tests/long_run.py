"""Whether this is a long run: ``MOECOMM_LONG=1`` raises every trial count of the suite (10⁵
round trips, 20 kill trials per backend, 100 chaos trials) and runs the tests marked ``slow``.
Read here once; conftest.py and the tests that size their trials import it (docs/env.md)."""

from __future__ import annotations

import os

LONG = os.environ.get("MOECOMM_LONG") == "1"
