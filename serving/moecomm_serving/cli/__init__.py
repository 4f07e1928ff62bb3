"""The ``moecomm`` command: the only layer that builds apps and starts processes.

:mod:`~moecomm_serving.cli.main` is the entry point (also ``python -m moecomm_serving.cli``);
one module per subcommand (``frontend``, ``router``, ``expert_server``, ``rebalance``, ``demo``,
``loadgen`` for ``moecomm bench``), and the option groups they share
(:mod:`~moecomm_serving.cli.common`, :mod:`~moecomm_serving.cli.device`).
"""
