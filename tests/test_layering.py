"""The layering of discovery/ and pipelines/, enforced from the source (no imports are executed).

Every module is parsed with ``ast``; every import counts, also those inside functions and under
``if TYPE_CHECKING:``, and relative imports are resolved (modules named in strings, as the registries'
lazy ``importlib`` entries are, are not seen). The rules:

- no import cycles between modules;
- no upward imports: discovery never imports pipelines; pipelines modules outside pipelines/commands/
  and pipelines/cli.py never import pipelines.commands or pipelines.cli; inside discovery a module only
  imports its own stage or lower ones, in the order base < model, tasks < measure < evidence < rank
  < report < toy (base = errors, io, registry, heads, stats, artifacts; toy may import anything in
  discovery; nothing imports toy);
- no module longer than ``MAX_LINES`` lines.

Importing ``a.b.c`` also runs ``a/__init__.py`` and ``a/b/__init__.py``; those implicit edges are not
counted (a package that re-exports its submodules would otherwise always be "in a cycle" with them), so a
submodule that imports its own package's ``__init__`` is reported as the cycle it really is.
"""
from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("discovery", "pipelines")
MAX_LINES = 600

BASE = {"errors", "io", "registry", "heads", "stats", "artifacts"}
STAGES = {"model": 1, "tasks": 1, "measure": 2, "evidence": 3, "rank": 4, "report": 5, "toy": 6}
STAGE_NAMES = {0: "base", 1: "model/tasks", 2: "measure", 3: "evidence", 4: "rank", 5: "report", 6: "toy"}


# -- the graph ---------------------------------------------------------------------------------------
def module_files(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the given top-level packages."""
    files = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join(parts)] = path
    return files


def _known(name: str, modules) -> str | None:
    """The longest prefix of ``name`` that is one of ``modules`` (``a.b.func`` -> ``a.b``)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def imports_of(module: str, path: Path, modules) -> set[str]:
    """The project modules that ``module`` imports anywhere in its file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                if node.level - 1 > len(base_parts) - 1:
                    raise AssertionError(f"{path}:{node.lineno}: relative import beyond the top package")
                base = ".".join(base_parts[: len(base_parts) - (node.level - 1)])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            # `from a.b import c` imports the module a.b.c when there is one, else names from a.b
            names = [f"{base}.{alias.name}" if alias.name != "*" else base for alias in node.names]
        else:
            continue
        for name in names:
            target = _known(name, modules)
            if target is not None and target != module:
                targets.add(target)
    return targets


def build_graph(root: Path = ROOT, packages=PACKAGES) -> tuple[dict[str, set[str]], dict[str, Path]]:
    files = module_files(root, packages)
    return {module: imports_of(module, path, files) for module, path in files.items()}, files


# -- the checks --------------------------------------------------------------------------------------
def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    out.append(sorted(component))
            elif child not in graph:
                continue
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def _shortest_cycle(graph: dict[str, set[str]], start: str, within: set[str]) -> list[str]:
    """A shortest path start -> ... -> start inside one component (BFS)."""
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph[node] & within):
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if child not in parent:
                parent[child] = node
                queue.append(child)
    raise AssertionError(f"{start} is in no cycle")


def find_cycles(graph: dict[str, set[str]]) -> list[str]:
    """One line per import cycle (strongly connected component): a shortest cycle and all its members."""
    lines = []
    for component in _components(graph):
        if len(component) > 1:
            cycle = _shortest_cycle(graph, component[0], set(component))
            lines.append(" -> ".join(cycle) + (f"   (component: {', '.join(component)})" if len(component) > 2 else ""))
    return lines


def stage_of(module: str) -> int | None:
    """A discovery module's stage (0 = base); None when it belongs to no stage."""
    parts = module.split(".")
    if parts == ["discovery"]:
        return 0
    if len(parts) >= 2 and parts[1] in BASE:
        return 0
    if len(parts) >= 2:
        return STAGES.get(parts[1])
    return None


def _is_pipelines_entry(module: str) -> bool:
    return module == "pipelines.cli" or module == "pipelines.commands" or module.startswith("pipelines.commands.")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """One line per import that goes against the layering."""
    problems = []
    for module in sorted(graph):
        top = module.split(".")[0]
        if top == "discovery" and stage_of(module) is None:
            problems.append(f"{module}: in no stage (add it to BASE or STAGES in tests/test_layering.py)")
        for target in sorted(graph[module]):
            target_top = target.split(".")[0]
            if top == "discovery" and target_top == "pipelines":
                problems.append(f"{module} imports {target}: discovery never imports pipelines")
            elif top == "pipelines" and not _is_pipelines_entry(module) and _is_pipelines_entry(target):
                problems.append(f"{module} imports {target}: only pipelines.commands / pipelines.cli import those")
            elif top == "discovery" and target_top == "discovery":
                mine, theirs = stage_of(module), stage_of(target)
                if mine is not None and theirs is not None and theirs > mine:
                    problems.append(
                        f"{module} ({STAGE_NAMES[mine]}) imports {target} ({STAGE_NAMES[theirs]}): a higher stage"
                    )
    return problems


def long_modules(files: dict[str, Path], limit: int = MAX_LINES) -> list[str]:
    out = []
    for module, path in sorted(files.items()):
        count = len(path.read_text(encoding="utf-8").splitlines())
        if count > limit:
            out.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: {count} lines > {limit}")
    return out


GRAPH, FILES = build_graph()


# -- the tree ----------------------------------------------------------------------------------------
def test_the_graph_covers_the_tree():
    assert "discovery.model.intervene" in GRAPH and "pipelines.cli" in GRAPH
    assert "discovery.model.adapter" in GRAPH["discovery.model.intervene"]


def test_no_import_cycles():
    cycles = find_cycles(GRAPH)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_upward_imports():
    problems = upward_imports(GRAPH)
    assert not problems, "imports against the layering:\n" + "\n".join(problems)


def test_no_module_is_too_long():
    problems = long_modules(FILES)
    assert not problems, "modules too long:\n" + "\n".join(problems)


# -- the checker itself can fail ---------------------------------------------------------------------
def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_a_planted_cycle_is_found(tmp_path):
    _write(tmp_path, {
        "discovery/__init__.py": "",
        "discovery/measure/__init__.py": "",
        "discovery/measure/a.py": "from discovery.measure.b import thing\n",
        # function-level and relative: b -> c -> a
        "discovery/measure/b.py": "def thing():\n    from . import c\n    return c\n",
        "discovery/measure/c.py": "def other():\n    from .a import thing\n",
        "discovery/measure/d.py": "from .a import thing\n",  # imports into the cycle, is not part of it
    })
    graph, _ = build_graph(tmp_path)
    assert graph["discovery.measure.b"] == {"discovery.measure.c"}
    assert graph["discovery.measure.c"] == {"discovery.measure.a"}
    cycles = find_cycles(graph)
    assert cycles == [(
        "discovery.measure.a -> discovery.measure.b -> discovery.measure.c -> discovery.measure.a"
        "   (component: discovery.measure.a, discovery.measure.b, discovery.measure.c)"
    )]


def test_a_submodule_importing_its_own_package_is_a_cycle(tmp_path):
    _write(tmp_path, {
        "discovery/__init__.py": "",
        "discovery/evidence/__init__.py": "from discovery.evidence.stage import run\n",
        "discovery/evidence/stage.py": "from discovery.evidence import helper\n",
    })
    graph, _ = build_graph(tmp_path)
    assert find_cycles(graph) == ["discovery.evidence -> discovery.evidence.stage -> discovery.evidence"]


def test_planted_upward_imports_are_found(tmp_path):
    _write(tmp_path, {
        "discovery/__init__.py": "",
        "discovery/errors.py": "",
        "discovery/rank/__init__.py": "",
        "discovery/rank/verdict.py": "from discovery.errors import GascanError\n",
        "discovery/measure/__init__.py": "",
        # upward, inside a function, relative with two dots
        "discovery/measure/ablation.py": "def f():\n    from ..rank.verdict import drop\n",
        "discovery/toy/__init__.py": "from discovery.rank import verdict\n",  # toy may import anything
        "discovery/stray.py": "",  # in no stage
        "discovery/model/__init__.py": "",
        "discovery/model/loading.py": "import pipelines.cli\n",
        "pipelines/__init__.py": "",
        "pipelines/cli.py": "from pipelines import batch\n",  # entry points may import anything
        "pipelines/batch.py": "from pipelines.commands.scan import run\n",
        "pipelines/commands/__init__.py": "",
        "pipelines/commands/scan.py": "from pipelines.batch import x\n",
    })
    graph, _ = build_graph(tmp_path)
    assert graph["discovery.measure.ablation"] == {"discovery.rank.verdict"}
    assert upward_imports(graph) == [
        "discovery.measure.ablation (measure) imports discovery.rank.verdict (rank): a higher stage",
        "discovery.model.loading imports pipelines.cli: discovery never imports pipelines",
        "discovery.stray: in no stage (add it to BASE or STAGES in tests/test_layering.py)",
        "pipelines.batch imports pipelines.commands.scan: only pipelines.commands / pipelines.cli import those",
    ]
    assert find_cycles(graph) == ["pipelines.batch -> pipelines.commands.scan -> pipelines.batch"]


def test_a_planted_long_module_is_found(tmp_path):
    _write(tmp_path, {"discovery/__init__.py": "", "discovery/big.py": "x = 1\n" * (MAX_LINES + 1)})
    _, files = build_graph(tmp_path)
    assert long_modules(files) == [f"{tmp_path / 'discovery/big.py'}: {MAX_LINES + 1} lines > {MAX_LINES}"]
