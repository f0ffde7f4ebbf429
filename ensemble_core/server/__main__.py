"""``python -m ensemble_core.server --members ... [--port 0]``: the same as ``ensemble serve``."""

import sys

from ensemble_core.server.cli import main

if __name__ == "__main__":
    sys.exit(main())
