"""``python -m actormesh.cli`` runs the ``actormesh`` console script."""

import sys

from . import main

sys.exit(main())
