"""Published results live in `results/` at the repository's root, outside every package: the wheel and
the sdist carry none of them; large raw files there are xz-compressed, and the tools that read a
run's files read them compressed or plain."""

from __future__ import annotations

import io
import json
import lzma
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from bench import result_files
from bench.gpu.compare import steps
from bench.gpu.host import capacity
from bench.routing_table import table
from tests.conftest import REPO

RESULTS = REPO / "results"
RAW = {".jsonl", ".json", ".log", ".txt", ".tsv"}
# A raw file above this is kept as NAME.xz (the largest report.json, a report and not raw, is 60 kB).
RAW_LIMIT = 64 * 1024


def _xz(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_name(path.name + ".xz").write_bytes(lzma.compress(text.encode()))


def test_the_tools_read_a_runs_files_compressed(tmp_path: Path) -> None:
    run = {
        "config": "radix_cache_aware",
        "load": "16 req/s",
        "ok": 10,
        "requests": 10,
        "ttft_ms": {"mean": 100.0, "p50": 90.0, "p99": 200.0},
        "cache_hit_rate": 0.9,
        "throughput_rps": 16.0,
    }
    _xz(tmp_path / "run" / "report.json", json.dumps({"meta": {"scenario": "routing (full)"}, "runs": [run]}))
    assert "| radix_cache_aware | 16 req/s | 10/10 | 100.0 | 90.0 | 200.0 |" in table([tmp_path / "run"])

    _xz(
        tmp_path / "kg" / "steps.jsonl", json.dumps({"step": "routing", "out": "routing/all", "rc": 0}) + "\n"
    )
    assert [s["step"] for s in steps(tmp_path / "kg")] == ["routing"]


def test_published_raw_records_are_compressed_and_still_read(capsys: pytest.CaptureFixture[str]) -> None:
    big = [
        p.relative_to(REPO)
        for p in RESULTS.rglob("*")
        if p.suffix in RAW and p.is_file() and p.stat().st_size > RAW_LIMIT
    ]
    assert not big, f"raw result files over {RAW_LIMIT} bytes, to compress with `xz -9e`: {big}"
    # The routing-long seed-5 collapse's per-request records, as the GPU host's capacity probe reads them.
    run = RESULTS / "routing" / "hard-workloads" / "gpu-host-seeds-4-6" / "routing-long-full-seed5"
    assert [p.name for p in result_files.glob(run / "records", "*.jsonl")] == [
        "prefix_affinity-10_req_s.jsonl.xz"
    ]
    assert capacity(run) == 0
    rate = float(capsys.readouterr().out)
    assert 1.0 < rate < 20.0  # completions/s of a run offered 10 req/s


def test_the_wheel_and_the_sdist_carry_no_results(tmp_path: Path) -> None:
    # A copy of the working tree (tracked and untracked files, as git sees them), so that the build's
    # own outputs stay out of the checkout.
    tree = tmp_path / "tree"
    tree.mkdir()
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in filter(None, listed.decode().split("\0")):
            if (REPO / name).exists():
                tar.add(REPO / name, arcname=name)
    buf.seek(0)
    with tarfile.open(fileobj=buf) as tar:
        tar.extractall(tree, filter="data")
    assert (tree / "results").is_dir()
    dist = tmp_path / "dist"
    for kind in ("wheel", "sdist"):
        build = f"import sys; from setuptools import build_meta; build_meta.build_{kind}(sys.argv[1])"
        out = subprocess.run(
            [sys.executable, "-c", build, str(dist)], cwd=tree, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    with zipfile.ZipFile(wheel) as z:
        in_wheel = z.namelist()
    with tarfile.open(sdist) as t:
        in_sdist = [name.split("/", 1)[1] for name in t.getnames() if "/" in name]
    assert "bench/scenarios/routing.yaml" in in_wheel  # the wheel does carry the benchmark's scenarios
    for names in (in_wheel, in_sdist):
        assert not [n for n in names if "results" in Path(n).parts], names
