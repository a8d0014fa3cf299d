"""The actor API under test, chosen by ``BENCH_IMPL`` (``actormesh`` or ``monarch``).

Workloads import ``Actor, endpoint, this_host, this_proc`` from here, so one
source runs against both implementations (the Monarch run happens in a
separate interpreter, /work/monarch-venv, as a subprocess).
"""

from __future__ import annotations

import os

IMPL = os.environ.get("BENCH_IMPL", "actormesh")

if IMPL == "monarch":
    from monarch.actor import Actor, endpoint, this_host, this_proc  # type: ignore[import-not-found]
elif IMPL == "actormesh":
    from actormesh.actor import Actor, endpoint, this_host, this_proc
else:  # pragma: no cover - misconfiguration
    raise RuntimeError(f"BENCH_IMPL must be 'actormesh' or 'monarch', got {IMPL!r}")

__all__ = ["IMPL", "Actor", "endpoint", "this_host", "this_proc"]
