"""Headless Chromium for the tests of pages (the status page, the control plane's docs page).

They need Debian's `chromium` (`make browser`, or `apt-get update && apt-get install -y chromium`);
without it they skip and say so.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium not installed (apt-get update && apt-get install -y chromium)"
)


async def chromium(tmp_path: Path, url: str, *mode: str) -> str:
    """Run headless Chromium on `url` with `mode` (--dump-dom or --screenshot=...); stdout."""
    assert CHROMIUM is not None
    profile = tempfile.mkdtemp(prefix="chromium-", dir=tmp_path)  # a fresh browser profile per run
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--window-size=1280,800",
        # Let the page's fetches and first refreshes run before the DOM or pixels are taken.
        "--virtual-time-budget=3000",
        *mode,
        url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode == 0, err.decode()[-2000:]
    return out.decode()
