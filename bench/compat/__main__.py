"""Entry point: ``python -m bench.compat --impl actormesh|monarch``."""

import sys

from bench.compat.cli import main

sys.exit(main())
