"""An idle nixl waiter: what it costs and how soon it wakes. NIXL gives a waiter nothing to block
on, so it polls; once it has been idle a while its sleeps grow, up to max_poll_ns
(csrc/transport/nixl/nixl_transport.h, kBackoffAfterNs). Measured here on real agents: the CPU
of an idle receiver process (every thread, NIXL's progress thread included) stays within 5 % of
a core, and a word signalled after a long idle still wakes its waiter within the back-off's
bound. Also: moecomm's UCX settings fill only the variables a user left unset."""

from __future__ import annotations

import threading
import time

import moecomm
import moecomm.wire.nixl
import pytest
from moecomm.wire.nixl import UCX_DEFAULTS, UCX_DEFAULTS_ENV, apply_ucx_defaults
from moecomm.wire.transport import WaitOp
from nixl_helpers import NIXL_OK, NIXL_WHY, WAIT_NS, S, idle_waiter, spawn, ucx_env_child

pytestmark = [
    pytest.mark.skipif(not NIXL_OK, reason=f"NIXL is not installed: {NIXL_WHY}"),
    pytest.mark.timeout(120),
]

# The bound on an idle waiter: a twentieth of a core.
IDLE_CORE_FRACTION = 0.05
IDLE_S = 3.0
# Long enough idle that an unbounded back-off would sleep for hundreds of ms at a time.
IDLE_BEFORE_SIGNAL_S = 1.0
# The bounded back-off wakes within max_poll_ns (1 ms) plus a notification's delivery; this
# leaves room for a loaded machine yet is far below what an unbounded one sleeps after 1 s idle
# (its sleeps double: ~0.5 s by then). The least of a few trials is taken: a trial can lose the
# CPU to other work, the back-off's bound shows in every trial.
WAKE_BOUND_S = 0.05
WAKE_TRIALS = 3


def test_an_idle_waiter_costs_at_most_five_percent_of_a_core(reaper):
    _p, _conn, (what, fraction) = spawn(reaper, idle_waiter, IDLE_S, {})
    assert what == "idle", "nobody signals the word, yet the wait ended"
    assert fraction <= IDLE_CORE_FRACTION, (
        f"an idle nixl waiter took {100 * fraction:.1f} % of a core over {IDLE_S} s "
        f"(bound {100 * IDLE_CORE_FRACTION:.0f} %)"
    )


def test_a_waiter_idle_for_a_second_wakes_within_the_back_off_bound():
    waiter = moecomm.wire.nixl.open_nixl_transport()
    assert waiter.max_poll_ns == 1_000_000  # the default bound the docs state
    region = waiter.create_region(64)
    sender = moecomm.wire.nixl.open_nixl_transport()
    peer = sender.attach(region.handle)
    latencies = []
    for value in range(1, WAKE_TRIALS + 1):
        woke = []

        def wait(value=value, woke=woke):
            got = waiter.wait(region, 0, WaitOp.EQUAL, value, timeout_ns=WAIT_NS)
            woke.append((time.monotonic(), got))

        th = threading.Thread(target=wait, daemon=True)
        th.start()
        time.sleep(IDLE_BEFORE_SIGNAL_S)
        assert not woke, "the waiter woke before its word was signalled"
        signalled = time.monotonic()
        sender.signal(peer, 0, value)
        th.join(WAIT_NS / S)
        assert woke and woke[0][1] == value, "the waiter did not see its word"
        latencies.append(woke[0][0] - signalled)
    assert min(latencies) <= WAKE_BOUND_S, (
        f"after {IDLE_BEFORE_SIGNAL_S} s idle a signalled waiter woke only after "
        f"{[round(x * 1e3, 1) for x in latencies]} ms (bound {WAKE_BOUND_S * 1e3:.0f} ms)"
    )


def test_a_back_off_bound_below_the_poll_interval_is_refused():
    with pytest.raises(ValueError, match="max_poll_ns >= poll_ns"):
        moecomm.wire.nixl.open_nixl_transport(poll_ns=20_000, max_poll_ns=10_000)


# ------------------------------------------------------------------------- UCX's settings
def test_ucx_defaults_fill_only_what_the_user_left_unset():
    assert UCX_DEFAULTS, "moecomm sets no UCX defaults: nothing to fill"
    defaults = {"UCX_A": "1", "UCX_B": "2", "UCX_C": "3"}
    env = {"UCX_A": "the user's", "PATH": "/bin"}
    applied = apply_ucx_defaults(env, defaults)
    assert applied == {"UCX_B": "2", "UCX_C": "3"}
    assert env == {"UCX_A": "the user's", "PATH": "/bin", "UCX_B": "2", "UCX_C": "3"}
    off = {UCX_DEFAULTS_ENV: "0"}
    assert apply_ucx_defaults(off, defaults) == {} and off == {UCX_DEFAULTS_ENV: "0"}


def test_an_agent_gets_the_ucx_defaults_unless_the_user_set_them(reaper):
    first = next(iter(UCX_DEFAULTS))
    # A value UCX accepts (the agent is made with it), and not moecomm's.
    user = {"y": "n", "n": "y"}.get(UCX_DEFAULTS[first], "auto")
    _p, _c, got = spawn(reaper, ucx_env_child, [{}, {first: user}, {UCX_DEFAULTS_ENV: "0"}])
    assert got[0] == UCX_DEFAULTS
    assert got[1] == {**UCX_DEFAULTS, first: user}
    assert got[2] == dict.fromkeys(UCX_DEFAULTS), "MOECOMM_NIXL_UCX_DEFAULTS=0 still set some"
