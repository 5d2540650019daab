import sys

from tools.loadgen.cli import main

sys.exit(main())
