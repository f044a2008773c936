"""Delete the shared libraries of a folder that no kept module needs (bench/gpu/build_payload.sh nixl).

The roots are the Python extension modules, NIXL's core library and the plugins and UCX transports
left in place; everything their ELF `NEEDED` entries reach, transitively, stays.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def _needed(path: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    return [line.split("[", 1)[1].split("]", 1)[0] for line in out.splitlines() if "(NEEDED)" in line]


def _root(lib: Path) -> bool:
    """An extension module, NIXL's core, a kept plugin or a UCX transport."""
    if lib.parent.name == "ucx":
        return True
    return lib.suffix == ".so" and (
        lib.parent.name in ("nixl_cu13", "plugins", "nixl") or lib.name == "libnixl.so"
    )


def prune(root: Path) -> list[Path]:
    libs = [Path(d) / f for d, _, files in os.walk(root) for f in files if ".so" in f]
    by_name: dict[str, list[Path]] = {}
    for lib in libs:
        by_name.setdefault(lib.name, []).append(lib)
    todo = [p for p in libs if _root(p)]
    seen: set[Path] = set()
    while todo:
        lib = todo.pop()
        if lib not in seen:
            seen.add(lib)
            todo += [dep for name in _needed(lib) for dep in by_name.get(name, [])]
    dropped = [p for p in libs if p not in seen]
    for p in dropped:
        p.unlink()
    return dropped


if __name__ == "__main__":
    gone = prune(Path(sys.argv[1]))
    print(f"pruned {len(gone)} libraries: {' '.join(sorted(p.name for p in gone))}")
