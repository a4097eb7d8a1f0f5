"""`python -m hotswap.cli ...`: the `hotswap` command (host_memory.py restarts it this way)."""

import sys

from hotswap.cli import main

sys.exit(main())
