"""actormesh benchmarks: ``python -m bench`` (see bench/README.md).

Kept import-light on purpose: worker processes of both actormesh and Monarch
import ``bench._actors`` (and so this package) to unpickle the actor classes, and
the RSS workload checks that torch is *not* loaded there.
"""
