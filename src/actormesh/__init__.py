"""actormesh: single-controller distributed programming for PyTorch, in pure Python.

Start with :mod:`actormesh.actor` (the Monarch-compatible API).
"""

__version__ = "0.1.0"
