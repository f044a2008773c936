"""`pip install kvgate` runs: the project installed into a fresh virtual environment with its
runtime dependencies only (and the extras the image installs), by the very script and arguments
the Docker image runs (docker/install.sh), starts `kvgate serve` on its embedded default config
(a launched fleet of simulated engines) and answers a completion. A runtime import of a dev-only
package (httpx was one) fails here.

The runtime dependencies (and the build backend) are fetched once from the package index into a
wheelhouse kept under ~/.cache/kvgate, keyed by the dependency list; the install then runs with
`PIP_NO_INDEX=1 PIP_FIND_LINKS=<wheelhouse>`, the same commands as the image, offline and quick.
Without a wheelhouse and with the index unreachable, the test is skipped, saying so."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port, wait_until_sync

INDEX = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple/")
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvgate"


def _index_unreachable() -> str | None:
    try:
        urllib.request.urlopen(INDEX.rstrip("/") + "/pip/", timeout=5).close()
    except (urllib.error.URLError, OSError) as exc:
        return f"package index {INDEX} unreachable ({exc}): cannot fetch the runtime dependencies"
    return None


def _run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float = 400) -> None:
    out = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{argv} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"


def image_extras() -> str:
    """The extras the Docker image installs: the argument of its `install.sh install` line."""
    found = re.search(r"install\.sh install /wheels ?(\S*)", (REPO / "docker" / "Dockerfile").read_text())
    assert found, "docker/Dockerfile does not install through docker/install.sh"
    return found.group(1)


def wheelhouse(extras: str) -> Path:
    """Wheels of the runtime dependencies, the extras' and the build backend, fetched once per list."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    optional = project["project"]["optional-dependencies"]
    wanted = [
        *project["project"]["dependencies"],
        *(dep for extra in filter(None, extras.split(",")) for dep in optional[extra]),
        *project["build-system"]["requires"],
    ]
    key = hashlib.sha256("\n".join([sys.version, *wanted]).encode()).hexdigest()[:16]
    house = CACHE / f"test-wheelhouse-{key}"
    if (house / ".complete").exists():
        return house
    unreachable = _index_unreachable()
    if unreachable:
        pytest.skip(unreachable)
    partial = Path(f"{house}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    _run([sys.executable, "-m", "pip", "download", "-q", "-d", str(partial), *wanted], env, REPO, timeout=600)
    (partial / ".complete").touch()
    partial.replace(house) if not house.exists() else shutil.rmtree(partial)
    return house


def test_the_readme_says_what_kvgate_bench_needs() -> None:
    """The wheel carries `bench`, but `kvgate bench` runs only with the `bench` extra."""
    readme = " ".join((REPO / "README.md").read_text().split())
    installing = readme[readme.index("**Installing.**") :]
    assert "`kvgate bench`, which also needs the `bench` extra: `pip install 'kvgate[bench]'`" in installing


def test_building_from_a_checkout_leaves_no_build_directory(tmp_path: Path) -> None:
    """`pip install <checkout>` builds in the checkout: setuptools' `build/` stayed there, and its
    copies of modules since deleted (gateway/config.py, now a package) went into the next wheel."""
    checkout = tmp_path / "checkout"
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    for name in files:
        if (REPO / name).is_file():  # a file deleted but not yet committed is still listed
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, checkout / name)
    stale = checkout / "build" / "lib" / "gateway"
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INDEX": "1"}
    wheels = tmp_path / "wheels"
    argv = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    argv += ["-w", str(wheels)]
    _run([*argv, str(checkout)], env, tmp_path)
    assert not (checkout / "build").exists()
    # A build/ left by an older build (here: a module the tree no longer has) is not packaged either.
    stale.mkdir(parents=True)
    (stale / "config.py").write_text("raise ImportError('stale')\n")
    for wheel in wheels.iterdir():
        wheel.unlink()
    _run([*argv, str(checkout)], env, tmp_path)
    (wheel,) = wheels.iterdir()
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    assert "gateway/config/__init__.py" in names and "gateway/config.py" not in names


@pytest.mark.timeout(600)
def test_a_fresh_install_with_runtime_dependencies_serves_a_completion(tmp_path: Path) -> None:
    extras = image_extras()
    house = wheelhouse(extras)
    venv = tmp_path / "venv"
    # The environment gets no pip of its own (ensurepip takes seconds): `pip` on PATH is this
    # test's, pointed at the new interpreter by PIP_PYTHON (pip's --python).
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "pip").write_text(f'#!/bin/sh\nexec {sys.executable} -m pip "$@"\n')
    (tools / "pip").chmod(0o755)
    # Nothing of this checkout on PYTHONPATH; the new environment's programs first on PATH.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join([str(venv / "bin"), str(tools), env.get("PATH", "")])
    env |= {
        "PIP_PYTHON": str(venv / "bin" / "python"),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(house),
    }
    script = str(REPO / "docker" / "install.sh")
    _run(["sh", script, "wheel", str(REPO), str(tmp_path / "wheels")], env, tmp_path)
    _run(["sh", script, "install", str(tmp_path / "wheels"), extras], env, tmp_path)
    # Runtime dependencies only: none of the dev extra came along.
    listed = subprocess.run(["pip", "list"], env=env, capture_output=True, text=True)
    installed = {line.split()[0].lower().replace("_", "-") for line in listed.stdout.splitlines()[2:]}
    assert "kvgate" in installed and not {"pytest", "httpx", "openai", "hypothesis"} & installed
    assert {"fastapi", "uvicorn", "fastapi-offline"} <= installed  # the control plane's

    port, control_port = free_port(), free_port()
    serve = subprocess.Popen(
        [str(venv / "bin" / "kvgate"), "serve", "--port", str(port)],
        env={**env, "KVGATE_CONTROL__ADMIN_KEY": "install-test", "KVGATE_CONTROL__PORT": str(control_port)},
        cwd=tmp_path,  # the default config's engine logs land here
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            assert serve.poll() is None, f"kvgate serve exited: {serve.stderr.read()[-3000:]}"  # type: ignore[union-attr]
            try:
                return urllib.request.urlopen(url + "/ready", timeout=2).status == 200
            except (urllib.error.URLError, OSError):
                return False

        wait_until_sync(ready, 90, "kvgate serve to be ready", 0.2)
        body = b'{"model": "llama", "prompt": "The tide at Texel", "max_tokens": 4}'
        request = urllib.request.Request(
            url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as resp:
            answer = resp.read()
        assert b'"completion_tokens":4' in answer.replace(b" ", b""), answer
        # The control plane: the admin API, and its docs page with the assets the wheels ship.
        control = f"http://127.0.0.1:{control_port}"
        request = urllib.request.Request(
            control + "/admin/pools", headers={"Authorization": "Bearer install-test"}
        )
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert b'"demo"' in resp.read()
        with urllib.request.urlopen(control + "/docs/static/swagger-ui-bundle.js", timeout=10) as resp:
            assert b"SwaggerUIBundle" in resp.read()
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            assert serve.wait(timeout=60) == 0
        finally:
            if serve.poll() is None:
                serve.kill()
    if "bench" not in extras.split(","):  # the image has no bench extra: one line says what to install
        bench = subprocess.run(
            [str(venv / "bin" / "kvgate"), "bench", "--help"], env=env, capture_output=True, text=True
        )
        assert bench.returncode == 2 and bench.stderr.strip().splitlines() == [
            "kvgate bench needs matplotlib: pip install 'kvgate[bench]'"
        ]
