import os
import signal

# Every engine started by a test checks the block manager's invariants after each step.
os.environ.setdefault("SPILLWAY_DEBUG_INVARIANTS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# A suite started in the background of a shell without job control inherits SIGINT ignored, and
# so would every process a test starts (exec keeps an ignored signal): the tests that stop a
# server or a script with Ctrl-C would wait in vain. A handler of this process's own is reset
# to the default in its children.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
