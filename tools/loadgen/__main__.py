import sys

if __package__:  # `python -m tools.loadgen`, or `python -m spillway.tools.loadgen` where it is installed
    from .cli import main
else:  # run as `python tools/loadgen`: the repository root holds `tools`
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tools.loadgen.cli import main

sys.exit(main())
