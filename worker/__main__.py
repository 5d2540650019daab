"""`python -m spillway.worker`: the worker program a local gateway starts (see main.local_main).

Its gateway decides when it stops (a SHUTDOWN message, or the launch pipe closing); it runs in
a session of its own, out of reach of a terminal's Ctrl-C. Once the worker has closed its
sockets it leaves with os._exit: the interpreter's teardown would only free what
the process is about to drop anyway, and it is where Triton's nanobind extension reports
every object still alive ("nanobind: leaked N instances!"): the model and the compiled
kernels, which the worker keeps for its whole life (and gc.freeze keeps from the collector).
"""

import os
import sys

from spillway.worker.main import local_main

code = local_main()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
