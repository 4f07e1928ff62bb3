"""``python -m moecomm_serving.cli``: the ``moecomm`` command."""

import sys

from moecomm_serving.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
