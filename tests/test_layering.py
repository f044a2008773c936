"""The house's layering, read from the code's own imports: which part of `gateway` may import which.

Every module of `gateway` belongs to one part (its subpackage, or a named top-level module), and
each part may import only the parts `MAY_IMPORT` names, so imports run one way:

    top (cli, server, runtime: the composition root) -> http | epp | control | observe -> path
        -> admission -> routing -> prompt | fleet -> base (build, config and its modules, errors, logs)

with `sim` beside them, sharing only the token counter. Imports made for type checking only count
too. Nothing may import in a circle: not at run time anywhere, and not even for type checking
outside the simulator. The README's module map is checked against `MAY_IMPORT`.

`python -m tests.test_layering` prints the graph as it is (which part imports which, how often).
"""

from __future__ import annotations

import ast
import re
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASE = frozenset({"gateway.build", "gateway.config", "gateway.errors", "gateway.logs"})
BASE_PACKAGES = ("gateway.config.",)  # their submodules are the base too
TOP = frozenset({"gateway", "gateway.__main__", "gateway.cli", "gateway.server", "gateway.runtime"})
SUBPACKAGES = ("http", "epp", "control", "observe", "path", "admission", "routing", "prompt", "fleet", "sim")
LOWER = ("path", "admission", "routing", "prompt", "fleet", "base")
MAY_IMPORT: dict[str, frozenset[str]] = {
    "top": frozenset({"top", "http", "epp", "control", "observe", *LOWER, "facade", "sim"}),
    "http": frozenset({"http", *LOWER}),
    "epp": frozenset({"epp", *LOWER}),
    "control": frozenset({"control", *LOWER}),
    "observe": frozenset({"observe", *LOWER}),
    "path": frozenset({"path", "admission", "routing", "prompt", "fleet", "base"}),
    "admission": frozenset({"admission", "routing", "prompt", "fleet", "base"}),
    "routing": frozenset({"routing", "prompt", "fleet", "base"}),
    "prompt": frozenset({"prompt", "base"}),
    "fleet": frozenset({"fleet", "base"}),
    "base": frozenset({"base"}),
    "facade": frozenset({"routing"}),  # gateway.policy: the plugin API's public path
    "sim": frozenset({"sim"}),
}
# Single modules a part may import beyond its rule: what the simulator shares with the gateway.
SHARED = {"sim": frozenset({"gateway.prompt.tokens"})}


def part(module: str) -> str:
    if module in BASE or module.startswith(BASE_PACKAGES):
        return "base"
    if module in TOP:
        return "top"
    if module == "gateway.policy":
        return "facade"
    name = module.split(".")[1] if module.count(".") else ""
    if name in SUBPACKAGES:
        return name
    raise AssertionError(f"{module} belongs to no part: put it in a subpackage (or name it in this test)")


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted((REPO / "gateway").rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, bool]]:
    """(imported gateway module, whether only for type checking) for each import in the module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[tuple[str, bool]] = []

    def target(module: str, names: list[str]) -> list[str]:
        subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in known]
        return subs if len(subs) == len(names) else [module]

    def visit(node: ast.AST, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for stmt in child.body:
                    visit_stmt(stmt, True)
                for stmt in child.orelse:
                    visit_stmt(stmt, typing_only)
            else:
                visit_stmt(child, typing_only)

    def visit_stmt(stmt: ast.AST, typing_only: bool) -> None:
        if isinstance(stmt, ast.Import):
            out.extend((a.name, typing_only) for a in stmt.names if a.name.split(".")[0] == "gateway")
        elif isinstance(stmt, ast.ImportFrom):
            if stmt.level:
                base = package.split(".")[: len(package.split(".")) - stmt.level + 1]
                module = ".".join([*base, stmt.module] if stmt.module else base)
            else:
                module = stmt.module or ""
            if module.split(".")[0] == "gateway":
                out.extend((m, typing_only) for m in target(module, [a.name for a in stmt.names]))
        else:
            visit(stmt, typing_only)

    visit(ast.parse(path.read_text()), False)
    return out


def graph() -> dict[str, list[tuple[str, bool]]]:
    found = modules()
    known = set(found)
    return {name: imports(name, path, known) for name, path in found.items()}


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle, if there is any."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := dfs(nxt)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := dfs(node)) is not None:
            return found
    return None


def rules_text() -> str:
    """`MAY_IMPORT` as the README's module map shows it."""
    order = [
        "top",
        "http",
        "epp",
        "control",
        "observe",
        "path",
        "admission",
        "routing",
        "prompt",
        "fleet",
        "base",
        "facade",
        "sim",
    ]
    lines = []
    for name in order:
        allowed = [p for p in order if p in MAY_IMPORT[name] and p != name]
        shared = sorted(SHARED.get(name, ()))
        may = ", ".join(allowed + shared) or "nothing"
        lines.append(f"{name:<9} may import: {may}")
    return "\n".join(lines)


def test_every_import_runs_down_the_layers() -> None:
    wrong = []
    for module, deps in graph().items():
        mine = part(module)
        for dep, _ in deps:
            if part(dep) not in MAY_IMPORT[mine] and dep not in SHARED.get(mine, ()):
                wrong.append(f"{module} ({mine}) imports {dep} ({part(dep)})")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_no_import_circles() -> None:
    g = graph()
    runtime = {m: {d for d, typing_only in deps if not typing_only and d != m} for m, deps in g.items()}
    assert _cycle(runtime) is None, (
        f"modules import each other in a circle: {' -> '.join(_cycle(runtime) or [])}"
    )
    # Type-only imports too, but for the simulator's api/server pair, which is the simulator's own affair.
    everything = {m: {d for d, _ in deps if d != m} for m, deps in g.items() if part(m) != "sim"}
    assert _cycle(everything) is None, (
        f"a circle through type-only imports: {' -> '.join(_cycle(everything) or [])}"
    )


def test_the_layering_test_sees_what_it_forbids() -> None:
    """The reader finds imports at any depth, type-only ones included, and resolves submodules."""
    g = graph()
    assert ("gateway.routing.pool_router", True) in g["gateway.admission.scheduler"]  # under TYPE_CHECKING
    assert ("gateway.control.rollout_cli", False) in g["gateway.cli"]  # inside a function
    assert ("gateway.fleet.engines.base", False) in g["gateway.fleet.engines.vllm"]
    assert ("gateway.http", False) not in g["gateway.runtime"]  # `from gateway.http.app import ...`


def test_config_is_one_import() -> None:
    """`gateway.config` is split by concern into modules, and every name they define is importable
    from `gateway.config` itself: importers never name a submodule."""
    import gateway.config as config

    missing = []
    for path in sorted((REPO / "gateway" / "config").glob("*.py")):
        if path.name == "__init__.py":
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            else:
                continue
            public = [n for n in names if not n.startswith("_")]
            missing += [f"{path.stem}.{n}" for n in public if n not in config.__all__]
    assert not missing, f"defined in gateway/config/ but not exported by gateway.config: {missing}"
    assert all(hasattr(config, name) for name in config.__all__)


def test_readme_module_map_states_these_rules() -> None:
    readme = (REPO / "README.md").read_text()
    assert rules_text() in readme, (
        "README's module map differs: paste `python -m tests.test_layering --rules`"
    )


def main(argv: list[str]) -> int:
    if argv[1:] == ["--rules"]:
        print(rules_text())
        return 0
    edges: Counter[tuple[str, str]] = Counter()
    for module, deps in graph().items():
        for dep, _ in deps:
            if part(module) != part(dep):
                edges[(part(module), part(dep))] += 1
    print("part imports part (how many imports)")
    for (a, b), n in sorted(edges.items()):
        print(f"  {a:<9} -> {b:<9} {n:>3}")
    print("\nmay import:\n" + rules_text())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))


# What only an engine adapter (gateway/fleet/engines/) may say: engine kinds and their hand-off
# protocols. The request path and routing speak through adapters, so a new engine kind is one
# adapter module and its test.
ENGINE_WORDS = re.compile(r"vllm|sglang|nixl|bootstrap|mooncake", re.IGNORECASE)
ENGINE_KINDS = frozenset({"vllm", "sglang", "sim", "openai"})


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def engine_names(path: Path) -> list[str]:
    """Engine names in a module's code (identifiers and strings; docstrings and comments explain)."""
    tree = ast.parse(path.read_text())
    explaining = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        text = None
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in explaining:
            if ENGINE_WORDS.search(node.value) or node.value in ENGINE_KINDS:
                text = node.value
        elif isinstance(
            node, ast.Name | ast.arg | ast.alias | ast.Attribute | ast.FunctionDef | ast.ClassDef
        ):
            name = {ast.Name: "id", ast.arg: "arg", ast.Attribute: "attr"}.get(type(node), "name")
            if ENGINE_WORDS.search(getattr(node, name)):
                text = getattr(node, name)
        if text is not None:
            found.append(f"{path.relative_to(REPO)}:{getattr(node, 'lineno', 0)}: {text[:60]!r}")
    return found


def test_no_engine_is_named_in_the_request_path_or_routing() -> None:
    named = [
        hit
        for sub in ("path", "routing")
        for p in sorted((REPO / "gateway" / sub).rglob("*.py"))
        for hit in engine_names(p)
    ]
    assert not named, (
        "engine names outside gateway/fleet/engines/ (say it through an adapter):\n" + "\n".join(named)
    )


def test_the_engine_name_check_sees_what_it_forbids() -> None:
    assert engine_names(REPO / "gateway" / "fleet" / "engines" / "nixl.py")  # the connector names itself
