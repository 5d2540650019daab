"""`python -m spillway.worker`: the worker program a local gateway starts (see main.local_main).

Its gateway decides when it stops (a SHUTDOWN message, or the launch pipe closing), so Ctrl-C,
which a terminal sends to the whole process group, is ignored here. Once the worker has
closed its sockets it leaves with os._exit: the interpreter's teardown would only free what
the process is about to drop anyway, and it is where Triton's nanobind extension reports
every object still alive ("nanobind: leaked N instances!"): the model and the compiled
kernels, which the worker keeps for its whole life (and gc.freeze keeps from the collector).
"""

import os
import signal
import sys

from spillway.worker.main import local_main

signal.signal(signal.SIGINT, signal.SIG_IGN)
code = local_main()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
