import sys

if not __package__:  # run as `python tools/loadgen`: the repository root holds `tools`
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.loadgen.cli import main  # noqa: E402

sys.exit(main())
