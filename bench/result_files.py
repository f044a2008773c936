"""Reading a benchmark's output files, plain or xz-compressed.

The published results (`results/` at the repository's root) keep large raw files (per-request
records, engine logs) as `NAME.xz`; a fresh run writes them plain. Every tool that reads a run's
files goes through here, so it reads both: asked for `records/a.jsonl`, it reads `records/a.jsonl`
or, when only that exists, `records/a.jsonl.xz`.
"""

from __future__ import annotations

import lzma
from pathlib import Path

XZ = ".xz"


def resolve(path: Path) -> Path:
    """`path` if it exists, else its compressed sibling `path.xz` if that exists, else `path`."""
    if path.exists() or path.suffix == XZ:
        return path
    packed = path.with_name(path.name + XZ)
    return packed if packed.exists() else path


def exists(path: Path) -> bool:
    return resolve(path).exists()


def read_text(path: Path) -> str:
    """The text of `path` or of `path.xz`; raises FileNotFoundError naming `path` when neither exists."""
    found = resolve(path)
    if found.suffix == XZ:
        return lzma.decompress(found.read_bytes()).decode()
    return found.read_text()


def glob(folder: Path, pattern: str) -> list[Path]:
    """The files matching `pattern` in `folder`, plain or compressed, by the name of their plain form
    (a file present both ways counts once, plain)."""
    found = {p.name: p for p in folder.glob(pattern + XZ)}
    found.update({p.name + XZ: p for p in folder.glob(pattern)})
    return [found[name] for name in sorted(found)]
