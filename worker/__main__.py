"""`python -m spillway.worker`: the worker program a local gateway starts (see main.local_main)."""

import sys

from spillway.worker.main import local_main

sys.exit(local_main())
