import os

# Every engine started by a test checks the block manager's invariants after each step.
os.environ.setdefault("SPILLWAY_DEBUG_INVARIANTS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
