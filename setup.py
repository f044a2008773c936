"""The build: the request path's modules (`gateway.build.COMPILED`) compiled with mypyc, on request.

`KVGATE_COMPILE=1` compiles or fails; `KVGATE_COMPILE=auto` compiles when mypyc imports and a C
compiler builds a Python extension, and installs the pure-Python modules (the same source)
otherwise; unset or `0`, it never compiles: compiled, these modules measured no faster than
interpreted on a two-core machine (results/overhead/README.md, "Compiled modules"), so a
compiled build is opt-in until a quiet host shows a gain. An editable install (`pip install -e`,
`make setup`) stays interpreted unless `KVGATE_COMPILE=1`: its extensions, built beside the
sources, would shadow the edits made to them."""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.build import build

ROOT = Path(__file__).resolve().parent


def _compiled_names() -> tuple[str, ...]:
    # By path: importing the `gateway` package would import its dependencies, not installed yet.
    spec = importlib.util.spec_from_file_location("_kvgate_build", ROOT / "gateway" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return tuple(module.COMPILED)


def _compiler_works() -> bool:
    """Whether the C compiler setuptools would use (CC honoured) builds against Python.h."""
    from distutils.ccompiler import new_compiler
    from distutils.errors import CCompilerError, DistutilsError
    from distutils.sysconfig import customize_compiler, get_python_inc

    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp, "probe.c")
        probe.write_text("#include <Python.h>\nint kvgate_probe(void) { return 0; }\n")
        compiler = new_compiler()
        customize_compiler(compiler)
        try:
            compiler.compile([str(probe)], output_dir=tmp, include_dirs=[get_python_inc()])
        except (CCompilerError, DistutilsError, OSError):
            return False
    return True


def _why_interpreted(mode: str) -> str | None:
    """Why this build installs the pure-Python modules; None to compile."""
    if mode == "0":
        return "KVGATE_COMPILE unset or 0 (set it to 1 or auto to compile)"
    if mode == "1":
        return None
    if "editable_wheel" in sys.argv:
        return "an editable install (set KVGATE_COMPILE=1 to compile one)"
    if importlib.util.find_spec("mypyc") is None:
        return "mypyc is not installed"
    if not _compiler_works():
        return "no working C compiler"
    return None


def ext_modules() -> list[Any]:
    mode = os.environ.get("KVGATE_COMPILE", "0")
    if mode not in ("0", "1", "auto"):
        raise SystemExit(f"KVGATE_COMPILE must be 0, 1 or unset, not {mode!r}")
    reason = _why_interpreted(mode)
    if reason is not None:
        print(f"kvgate: installing interpreted modules only: {reason}", file=sys.stderr)
        return []
    from mypyc.build import mypycify

    paths = [str(Path(*name.split("."))) + ".py" for name in _compiled_names()]
    # The project's own type check (pyproject.toml, with the pydantic plugin) where the dependencies
    # are installed (`make test-compiled`, a build without isolation). An isolated build environment
    # has none of them, so there an empty configuration that reads no installed package's types
    # (mypy would find those of the target environment, pydantic's without its plugin). A
    # third-party module missing is typed as Any, which mypyc treats as a plain Python object.
    if importlib.util.find_spec("pydantic") is not None:
        options = ["--config-file", str(ROOT / "pyproject.toml")]
    else:
        options = ["--config-file", os.devnull, "--no-site-packages"]
    options.append("--ignore-missing-imports")
    return mypycify([*options, *paths], opt_level="3", group_name="kvgate")


class BuildOutsideTheTree(build):
    """`pip install <checkout>` builds in the checkout, and setuptools left its `build/` there, whose
    copies of modules since deleted or moved went into the next wheel: build in a temporary
    directory instead, removed when the build ends."""

    def initialize_options(self) -> None:
        super().initialize_options()
        self.build_base = tempfile.mkdtemp(prefix="kvgate-build-")
        atexit.register(shutil.rmtree, self.build_base, True)


setup(ext_modules=ext_modules(), cmdclass={"build": BuildOutsideTheTree})
