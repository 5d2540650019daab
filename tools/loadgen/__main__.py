import sys

if __package__:  # `python -m tools.loadgen`, or `python -m spillway.tools.loadgen` where it is installed
    from .cli import main
else:  # run as `python tools/loadgen`
    from spillway.tools.loadgen.cli import main

sys.exit(main())
