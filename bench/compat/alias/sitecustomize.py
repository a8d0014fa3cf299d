"""Installs the monarch -> actormesh import alias in every interpreter started with this
directory on ``PYTHONPATH`` (the pytest process, and the worker processes it spawns)."""

import monarch_alias  # noqa: F401  (installs the finder on import)
