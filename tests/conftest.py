import os
import signal

import pytest

# Every engine started by a test checks the block manager's invariants after each step.
os.environ.setdefault("SPILLWAY_DEBUG_INVARIANTS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Set before torch is first imported (its OpenMP runtime reads it once), and inherited by every
# worker, rank and server a test starts. Tests run several such processes at once (the gateway,
# the worker, the test's own client) on a machine that may run others: with OpenMP's default
# spin-waiting, a thread done with its share of an operation holds its core, waiting for a peer
# that another process has preempted, and a step takes several times as long. Passive threads
# sleep instead.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# A suite started in the background of a shell without job control inherits SIGINT ignored, and
# so would every process a test starts (exec keeps an ignored signal): the tests that stop a
# server or a script with Ctrl-C would wait in vain. A handler of this process's own is reset
# to the default in its children.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`make test`: one worker a core, `--dist loadgroup`), every test that
    needs the GPU runs on the same worker, one after another: side by side on one device they
    would compete for its memory and time each other's graphs."""
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.xdist_group("gpu"))
