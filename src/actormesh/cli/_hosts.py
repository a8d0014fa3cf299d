"""What the job commands share: the applied job's record as a table, and host selectors.

A host selector names hosts of the job's meshes:

=====================  ==============================================
``all``                every host of every mesh
``trainers``           every host of mesh ``trainers``
``trainers[1]``        host 1 of ``trainers``
``trainers[0:2]``      hosts 0 and 1 (Python slice, end excluded)
``trainers[0,3]``      hosts 0 and 3
``trainers[0],eval``   several selectors, separated by commas
=====================  ==============================================
"""

from __future__ import annotations

import re
import time
from typing import Any

import click

__all__ = ["parse_selector", "hosts_table", "applied_or_fail"]

_ITEM = re.compile(r"([A-Za-z_]\w*)(?:\[([^\]]*)\])?")


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [*parts, cur]


def _indices(spec: str, size: int, item: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        m = re.fullmatch(r"(-?\d*):(-?\d*)", part)
        if m:
            lo = int(m.group(1)) if m.group(1) else None
            hi = int(m.group(2)) if m.group(2) else None
            out.extend(range(size)[lo:hi])
        elif re.fullmatch(r"-?\d+", part):
            i = int(part)
            if not -size <= i < size:
                raise ValueError(f"{item}: host {i} is out of range (the mesh has {size} hosts: 0..{size - 1})")
            out.append(i % size)
        else:
            raise ValueError(f"{item}: {part!r} is not a host index, a slice like 0:2, or a list like 0,3")
    return out


def parse_selector(text: str, meshes: dict[str, int]) -> list[tuple[str, int]]:
    """``[(mesh, host index)]`` that ``text`` selects, in order, without repeats.

    >>> parse_selector("a[1],b", {"a": 2, "b": 1})
    [('a', 1), ('b', 0)]
    """
    if text.strip() == "all":
        return [(name, i) for name, size in meshes.items() for i in range(size)]
    picked: list[tuple[str, int]] = []
    for item in _split_top(text):
        item = item.strip()
        m = _ITEM.fullmatch(item)
        if not m:
            raise ValueError(f"bad host selector {item!r}: use all, MESH, MESH[i], MESH[i:j] or MESH[i,j]")
        name, spec = m.group(1), m.group(2)
        if name not in meshes:
            raise ValueError(f"{item}: the job has no mesh {name!r}; its meshes are {', '.join(meshes) or 'none'}")
        idx = range(meshes[name]) if spec is None else _indices(spec, meshes[name], item)
        picked.extend((name, i) for i in idx)
    out = list(dict.fromkeys(picked))
    if not out:
        raise ValueError(f"host selector {text!r} selects no host")
    return out


def hosts_table(record: dict[str, Any]) -> Any:
    """A rich Table of the applied job's hosts."""
    from rich.table import Table

    age = time.time() - float(record.get("applied_at", time.time()))
    table = Table(title=f"{record.get('job')}  (keeper pid {record.get('keeper_pid')}, up {age:.0f}s)", title_justify="left")
    for col in ("mesh", "host", "hostname", "agent address", "agent pid", "cpus"):
        table.add_column(col)
    for name, hosts in record.get("meshes", {}).items():
        for i, h in enumerate(hosts):
            table.add_row(name, str(i), str(h.get("hostname")), str(h.get("address")), str(h.get("pid")), str(h.get("cpus")))
    return table


def applied_or_fail() -> Any:
    """The running AppliedJob of this directory, or a ClickException that says how to get one."""
    import os

    from ..job import APPLIED_DIR, applied_job

    job = applied_job()
    if job is not None:
        return job
    error = os.path.join(APPLIED_DIR, "error.txt")
    if os.path.exists(error):
        with open(error) as f:
            why = f.read().strip()
        raise click.ClickException(f"the job applied here is not running: {why} (log: {os.path.join(APPLIED_DIR, 'keeper.log')}); "
                                   "run `actormesh apply job.py` again")
    raise click.ClickException(f"no job is applied in {os.getcwd()}: run `actormesh apply job.py` here first")
