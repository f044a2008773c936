"""Checks that what a user reads leads somewhere inside the repository.

    python docs/check_links.py                 # everything below
    python docs/check_links.py FILE ...        # those files (Markdown or YAML)

Markdown links (every tracked .md file): each `](path)` target exists and each `#anchor` is a
heading. Anchors are GitHub's: the heading lowercased, punctuation but hyphens and underscores
dropped, spaces as hyphens, a repeated heading suffixed -1, -2, ... Links to http(s) and mailto are
not checked.

Plain-text references, in the pages a user reads (the README, DEVELOPERS.md, docs/, the other
READMEs outside results/' runs), the help of every command (`kvgate ...`, `python -m bench...`, the
simulator's, its profiles' sources that it prints at start) and the shipped YAML (config/, the
embedded default, the benchmark's scenarios, the Helm values, compose files):
- a path that names a file or folder of the repository (`gateway/config.py`, `results/pd/`,
  `bench/scenarios/*.yaml`) exists; paths git ignores (`results/out/...`) are outputs, not checked;
- a relative path with a file suffix (`x/y.md`, `a/b.sh`) resolves in the repository (from the
  file's folder, the root or a package), unless it names an upstream project's source (`vllm/...`);
- a bare `NAME.md` or `NAME.sh` is a file of the repository;
- no tracker numbers (`issue 18`, `#29`): say the fact instead;
- no file outside the repository (`../x`, the notes folder `shared/`, an absolute path to a file
  outside the system's folders).

Exits 1 and lists what is broken.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")

# A path-like token: components of word characters, dots and hyphens (globs and placeholders allowed
# after the first) joined by slashes, or a bare file name with a suffix that names a repository file.
PATH = re.compile(r"(?<![\w/:.~@$=-])((?:\.\.?/)*[\w.-]+(?:/[\w.*<>{}-]+)+/?|[\w-]+\.(?:md|sh))(?![\w/])")
TRACKER = re.compile(r"\b[Ii]ssues?\s+#?\d+\b|(?<![\w&/#(\]-])#\d+\b")
# Where a path turns into a pattern: a glob, a <placeholder>, a {field} or a NAME in capitals
# (`deploy/RELEASE-kvgate`, `KG/res/`); only the part before it is checked.
PLACEHOLDER = re.compile(r"[*<{]|(?:^|(?<=/))[A-Z][A-Z0-9_]{1,}(?=-|/|$)")
# An absolute path (`/etc/kvgate/config.yaml`, an API route `/v1/models`); one naming a file
# outside the usual system folders is a file of one machine, which a reader cannot open.
ABSOLUTE = re.compile(r"(?<![\w.~:/@-])(/([\w.-]+)(?:/[\w.*<>{}-]+)+)")
SYSTEM_DIRS = {"etc", "tmp", "var", "usr", "opt", "proc", "dev", "sys", "run"}
FILE_SUFFIX = re.compile(r"\.(md|py|sh|yaml|yml|json|jsonl|toml|txt|png|html)$")
# Relative paths into other projects' source trees, cited as such ("vLLM's vllm/config/cache.py").
UPSTREAM = {"vllm", "sglang"}
# Paths outside the repository that are defaults of a setting, not citations: where the benchmark
# looks for the Mooncake traces when neither --data-dir nor KVGATE_MOONCAKE_DIR says
# (bench.workloads.DEFAULT_MOONCAKE_DIR).
OUTSIDE_DEFAULTS = {"../shared/data/mooncake"}
# Where a package-relative path (`path/proxy.py`, `sim/cpu_tier.py`) may start.
PACKAGES = (REPO / "gateway", REPO / "bench", REPO)

# Commands whose help a user reads: each module's main() builds its parser (its sub-commands' too).
COMMANDS = (
    "gateway.cli",
    "gateway.control.rollout_cli",
    "gateway.fleet.render_k8s",
    "gateway.sim.cli",
    "bench.cli",
    "bench.overhead",
    "bench.soak",
    "bench.loop_block",
    "bench.conn_flood",
    "bench.decision_time",
    "bench.routing_table",
    "bench.scheduling_report",
    "bench.sim_calibration",
    "bench.echo_upstream",
    "bench.gpu.compare",
    "bench.gpu.host",
    "bench.gpu.pd",
)
YAML_GLOBS = (
    "config/*.yaml",
    "gateway/default_config.yaml",
    "bench/scenarios/*.yaml",
    "bench/gpu/*.yaml",
    "deploy/helm/kvgate/values.yaml",
    "docker-compose*.yml",
)


def slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[str]:
    out = []
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.extend(LINK.findall(line))
    return out


def broken(path: Path) -> list[str]:
    wrong = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            wrong.append(f"{_name(path)}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            wrong.append(f"{_name(path)}: {target}: no heading #{anchor}")
    return wrong


def _name(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    return [name for name in out.stdout.decode().split("\0") if name and (REPO / name).exists()]


def _ignored(names: Iterable[str]) -> set[str]:
    """The paths among `names` (relative to the root) that git ignores: outputs, not references."""
    names = list(names)
    if not names:
        return set()
    out = subprocess.run(
        ["git", "check-ignore", "--no-index", "--stdin", "-z"],
        cwd=REPO,
        input="\0".join(names).encode(),
        capture_output=True,
    )
    return set(filter(None, out.stdout.decode().split("\0")))


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _helps(parser: argparse.ArgumentParser) -> Iterator[str]:
    yield parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _helps(sub)


def command_help(module: str) -> str:
    """The help of `module`'s command and of its sub-commands: its main() is run until it parses."""

    def caught(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise _Parsed(self)

    main: Callable[..., object] = importlib.import_module(module).main
    original = argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_known_args = caught  # type: ignore[assignment,method-assign]
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "10000"  # one line per help text: a path is never cut by wrapping
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            main(*([[]] if inspect.signature(main).parameters else []))
    except _Parsed as parsed:
        return "\n".join(_helps(parsed.parser))
    finally:
        argparse.ArgumentParser.parse_known_args = original  # type: ignore[method-assign]
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    raise AssertionError(f"{module}.main() returned without parsing its arguments")


def simulator_profiles() -> str:
    from gateway.sim.profiles import PROFILES

    return "\n".join(f"{p.name}: {p.source}" for p in PROFILES.values())


def _exists(token: str, base: Path, names: set[str]) -> bool:
    stem = PLACEHOLDER.split(token, maxsplit=1)[0]
    if stem != token:  # a pattern: the folder it starts in
        stem = stem.rsplit("/", 1)[0] if "/" in stem else ""
    elif "/" not in token.rstrip("/"):  # a bare NAME.md: anywhere in the repository
        return (base / token).exists() or any(n.rsplit("/", 1)[-1] == token for n in names)
    return not stem or any((root / stem).exists() for root in (base, *PACKAGES))


def references(
    label: str, text: str, base: Path, top: set[str], names: set[str]
) -> Iterator[tuple[str, str]]:
    """(where, what is wrong) for each plain-text reference of `text` that leads nowhere."""
    for lineno, line in enumerate(text.splitlines(), 1):
        where = f"{label}:{lineno}"
        for m in TRACKER.finditer(line):
            yield where, f"{m.group(0)!r} cites a tracker: say the fact"
        for m in ABSOLUTE.finditer(line):
            if FILE_SUFFIX.search(m.group(1)) and m.group(2) not in SYSTEM_DIRS:
                yield where, f"{m.group(1)}: a file outside the repository"
        for m in PATH.finditer(line):
            token = m.group(1).rstrip(".")
            if token in OUTSIDE_DEFAULTS or token.startswith("..."):  # `.../x.py`: a path elided
                continue
            first = token.lstrip("./").split("/", 1)[0]
            if first == "shared" or (
                token.startswith("../") and not (base / token).resolve().is_relative_to(REPO)
            ):
                yield where, f"{token}: outside the repository"
            elif token.startswith(".") and not token.startswith(".."):
                continue  # local state (.venv/, .gpu/): made by a command, not shipped
            elif first in top or token.startswith("../") or "/" not in token:
                if not _exists(token, base, names):
                    yield where, f"{token}: no such file in the repository"
            elif (
                FILE_SUFFIX.search(token)
                and first not in UPSTREAM
                and not PLACEHOLDER.search(token)  # `records/*.jsonl`: a run's output, by pattern
                and not _exists(token, base, names)
            ):
                yield where, f"{token}: no such file in the repository"


def user_pages(names: set[str]) -> list[Path]:
    pages = [
        n for n in names if n.endswith(".md") and (not n.startswith("results/") or n == "results/README.md")
    ]
    return [REPO / n for n in sorted(pages)]


def shipped_yaml() -> list[Path]:
    return sorted({p for pattern in YAML_GLOBS for p in REPO.glob(pattern)})


def plain_text(sources: list[tuple[str, str, Path]], names: set[str]) -> list[str]:
    top = {n.split("/", 1)[0] for n in names}
    found = [
        (where, why)
        for label, text, base in sources
        for where, why in references(label, text, base, top, names)
    ]
    # A path git ignores is an output (results/out/...), named as where a command writes.
    tokens = {why.split(": ", 1)[0] for _, why in found if why.endswith("no such file in the repository")}
    outputs = _ignored(tokens)
    return [f"{where}: {why}" for where, why in found if why.split(": ", 1)[0] not in outputs]


def main(argv: list[str]) -> int:
    names = set(tracked())
    if argv:
        files = [Path(a).resolve() for a in argv]
        pages = [f for f in files if f.suffix == ".md"]
        texts = files
        helps: list[tuple[str, str, Path]] = []
    else:
        pages = [REPO / n for n in sorted(names) if n.endswith(".md")]
        texts = [*user_pages(names), *shipped_yaml()]
        helps = [(f"`{m}` help", command_help(m), REPO) for m in COMMANDS]
        helps.append(("simulator profiles", simulator_profiles(), REPO))
    wrong = [w for f in pages for w in broken(f)]
    count = sum(len(links(f)) for f in pages)
    sources = [(_name(f), f.read_text(), f.parent) for f in texts] + helps
    wrong += plain_text(sources, names)
    for w in wrong:
        print(w)
    print(f"{len(pages)} pages, {count} links, {len(sources)} texts read for references, {len(wrong)} broken")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
