"""What tests, benchmarks and demos of moecomm share, one module a role:

- ``identity``: an identity expert server and self-checking payloads (the protocol demo, the
  wire tests, `bench/wire/rtt.py`);
- ``procs``: moecomm processes started in groups of their own, waited for through their ready
  file (:mod:`moecomm.readiness`), always stopped with their shared memory reaped
  (:class:`Processes`), forked from a preloaded server in a test run (:mod:`moecomm.prefork`;
  :func:`forking_env` passes that on to a benchmark a test runs);
- ``cluster``: a whole local deployment from the `moecomm` command (monitor, expert servers,
  front ends of any role, router) with one teardown (:func:`start_local_cluster`);
- ``clients``: attention clients set up as tests use them (:func:`connect_client`).

Names are looked up lazily in their modules: the process harness needs no torch.
"""

import importlib

_LAZY = {
    "PATTERN_EXPERTS": "identity",
    "PATTERN_MOD": "identity",
    "SCORE_MOD": "identity",
    "CONTROL_POLL_S": "identity",
    "STOP": "identity",
    "IdentityServer": "identity",
    "check_pattern": "identity",
    "make_pattern": "identity",
    "serve_identity": "identity",
    "spawn_identity_server": "identity",
    "CLI_ARGV": "procs",
    "MONITOR_CMD": "procs",
    "Proc": "procs",
    "ProcessStartError": "procs",
    "Processes": "procs",
    "forking_env": "procs",
    "wait_all": "procs",
    "FrontendSpec": "cluster",
    "LocalCluster": "cluster",
    "start_local_cluster": "cluster",
    "attention_client": "clients",
    "connect_client": "clients",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = sorted(_LAZY)
