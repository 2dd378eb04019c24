"""The code's shape, checked on its source: the folders import one another as
docs/architecture.md's picture draws it, no import cycle among engine/, trainer/, bench/ and
app/ (imports inside functions count too), app/ reaches drafters only through the registry
and the Drafter interface, never by a drafter class's name, no script patches `sys.path`
(each runs as `python -m scripts.NAME`), and the README stays an overview (details in docs/)."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import engine.drafters
from engine.decode.drafter import Drafter

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "trainer", "bench", "app")
ARCHITECTURE = ROOT / "docs" / "architecture.md"
README_MAX_LINES = 250


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of PACKAGES."""
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _runtime_nodes(tree: ast.AST, typing: bool = False):
    """Every node of `tree` outside `if TYPE_CHECKING:` blocks (imports there never run),
    or with `typing`, every node."""
    skip = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and not typing
            and getattr(block.test, "id", getattr(block.test, "attr", "")) == "TYPE_CHECKING"
            for stmt in block.body for n in ast.walk(stmt)}
    return [n for n in ast.walk(tree) if id(n) not in skip]


def import_graph(typing: bool = False) -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its source (with `typing`,
    the imports only type checkers read too)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in _runtime_nodes(ast.parse(path.read_text()), typing):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, one level up per extra dot
                    up = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{up}.{base}" if base else up
                edges |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                          for a in node.names}
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as a list of modules (first == last); [] when there is none."""
    done: set[str] = set()
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        if node in stack:
            return [*stack[stack.index(node):], node]
        if node in done:
            return []
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if cycle := visit(nxt):
                return cycle
        stack.pop()
        done.add(node)
        return []

    for start in sorted(graph):
        if cycle := visit(start):
            return cycle
    return []


def test_the_finder_sees_a_cycle_through_a_lazy_import():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
    graph = import_graph()
    # imported in a function:
    assert "engine.drafters.accelerators" in graph["engine.drafters.registry"]


def test_engine_trainer_and_app_have_no_import_cycle():
    assert find_cycle(import_graph()) == []


def test_no_two_modules_import_each_other_even_for_type_checkers():
    assert find_cycle(import_graph(typing=True)) == []


def folder(module: str) -> str:
    """The folder a module lives in, as the picture names it: `engine` is the engine's own
    modules at its top (the foundation), `engine/decode` one of its folders, `app` the
    whole app (its subfolders are parts of one layer)."""
    parts = module.split(".")
    if parts[0] == "engine" and len(parts) > 1 and (ROOT / "engine" / parts[1]).is_dir():
        return f"engine/{parts[1]}"
    return parts[0]


def folder_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer, imported) folders over `graph`'s edges between different folders."""
    return {(folder(a), folder(b)) for a, targets in graph.items() for b in targets
            if folder(a) != folder(b)}


def drawn_edges(text: str) -> set[tuple[str, str]]:
    """The edges of the picture in the first fenced block under "## Layers": one line per
    folder, `FOLDER/ -> FOLDER/, FOLDER/, ...` (`-` for none)."""
    block = text.split("## Layers", 1)[1].split("```", 2)[1]
    edges = set()
    for line in block.splitlines():
        if "->" in line:
            left, right = (side.strip() for side in line.split("->", 1))
            edges |= {(left.rstrip("/"), target.strip().rstrip("/"))
                      for target in right.split(",") if target.strip() not in ("", "-")}
    return edges


def test_the_folder_finder_and_the_picture_reader():
    assert folder("engine.decode.generate") == "engine/decode"
    assert folder("engine.weights.kernels") == "engine/weights"
    assert folder("engine.drafters") == "engine/drafters"
    assert folder("engine.errors") == "engine"
    assert folder("app.ui.layout") == "app"
    graph = {"app.ui.layout": {"engine.decode.tree", "app.service"}, "engine.decode.tree": set()}
    assert folder_edges(graph) == {("app", "engine/decode")}
    text = "## Layers\n\n```\napp/ -> engine/decode/, engine/\nengine/ -> -\n```\n"
    assert drawn_edges(text) == {("app", "engine/decode"), ("app", "engine")}


def test_the_architecture_picture_is_the_real_imports():
    """docs/architecture.md draws which folder imports which: every import the code has
    between folders is drawn, and every line drawn is an import the code has."""
    real = folder_edges(import_graph(typing=True))
    drawn = drawn_edges(ARCHITECTURE.read_text(encoding="utf-8"))
    assert real - drawn == set(), f"imports the picture lacks: {sorted(real - drawn)}"
    assert drawn - real == set(), f"drawn but never imported: {sorted(drawn - real)}"
    layers = {a: set() for a, _ in drawn} | {b: set() for _, b in drawn}
    for a, b in drawn:
        layers[a].add(b)
    assert find_cycle(layers) == []


def drafter_classes() -> set[str]:
    """Names of every class of engine/drafters/ that drafts (the interface itself aside)."""
    for info in pkgutil.iter_modules(engine.drafters.__path__):
        importlib.import_module(f"engine.drafters.{info.name}")
    found, todo = set(), [Drafter]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("engine.drafters."):
                found.add(sub.__name__)
            todo.append(sub)
    return found


def test_app_names_no_drafter_class():
    classes = drafter_classes()
    assert {"MedusaDrafter", "KangarooDrafter", "Composite", "StoreDrafter"} <= classes
    for path in (ROOT / "app").rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        names |= {a.name.rpartition(".")[2] for n in ast.walk(tree)
                  if isinstance(n, ast.ImportFrom | ast.Import) for a in n.names}
        assert not names & classes, f"{path.relative_to(ROOT)} names {names & classes}"


def path_patches(folder: Path) -> list[str]:
    """Files under `folder` that name sys.path (compiled caches aside)."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts
                  and b"sys.path" in p.read_bytes())


def test_the_finder_sees_a_path_patch(tmp_path):
    (tmp_path / "clean.py").write_text("import sys\n")
    (tmp_path / "patched.py").write_text("import sys\nsys.path.insert(0, '..')\n")
    assert path_patches(tmp_path) == ["patched.py"]


def test_no_script_patches_sys_path():
    assert path_patches(ROOT / "scripts") == []


def test_the_readme_stays_an_overview():
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move details to docs/"


def generate_callers(sources: dict[str, str]) -> set[str]:
    """The modules (name -> source) that call the decode loop: engine.decode.generate's
    `generate` or `run`, imported by name or reached through the module."""
    loop = {"generate", "run"}
    found = set()
    for name, source in sources.items():
        tree = ast.parse(source)
        names, modules = set(), set()  # local names of the loop's functions and of its module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "engine.decode.generate":
                names |= {a.asname or a.name for a in node.names if a.name in loop}
            elif isinstance(node, ast.ImportFrom) and node.module == "engine.decode":
                modules |= {a.asname or a.name for a in node.names if a.name == "generate"}
            elif isinstance(node, ast.Import):
                modules |= {a.asname or a.name for a in node.names
                            if a.name == "engine.decode.generate"}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if (isinstance(f, ast.Name) and f.id in names) or (
                    isinstance(f, ast.Attribute) and f.attr in loop
                    and ast.unparse(f.value) in modules):
                found.add(name)
    return found


def test_the_caller_finder_sees_each_way_of_reaching_the_loop():
    sources = {
        "a": "from engine.decode.generate import generate\ngenerate(lm, ids, p)",
        "b": "from engine.decode.generate import run as r\ndef f():\n    return r(lm, ids, p)",
        "c": "import engine.decode.generate\nengine.decode.generate.generate(lm, ids, p)",
        "d": "from engine.decode import generate as g\ng.run(lm, ids, p)",
        # not the loop:
        "e": "from engine.decode.generate import StepEvent\nself.model.generate(ids)",
    }
    assert generate_callers(sources) == {"a", "b", "c", "d"}


def test_one_module_of_app_calls_the_decode_loop():
    """The page, the API, the terminal chat and Compare reply through app/reply_core.py."""
    sources = {".".join(path.relative_to(ROOT).with_suffix("").parts): path.read_text()
               for path in (ROOT / "app").rglob("*.py")}
    assert generate_callers(sources) == {"app.reply_core"}


def reached(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_reach_finder_follows_imports_through_others():
    graph = {"engine.model.loading": {"engine.weights.quant_auto"},
             "engine.weights.quant_auto": {"engine.drafters.x"}}
    assert "engine.drafters.x" in reached(graph, "engine.model.loading")
    assert reached({"a": {"b"}, "c": {"a"}}, "a") == {"b"}


def test_loading_depends_on_no_drafter():
    """Model loading times steps with engine.decode.timing, never through a drafter."""
    drafters = {m for m in reached(import_graph(), "engine.model.loading")
                if m.startswith("engine.drafters")}
    assert not drafters, f"engine.model.loading reaches {sorted(drafters)}"


# What times a decode step's cost: defined once, in engine/decode/timing.py (a drafter's own round,
# e.g. engine.drafters.payoff.round_seconds, is timed on top of it, not beside it).
STEP_TIMERS = {"step_cost", "step_costs", "step_seconds", "plain_step_seconds", "StepCost",
               "StepTimer", "PlainStep"}


def step_timers(sources: dict[str, str]) -> set[str]:
    """The modules (name -> source) that define a step-cost timer at their top level."""
    return {name for name, source in sources.items()
            for node in ast.parse(source).body
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name in STEP_TIMERS}


def test_the_timer_finder_sees_a_second_timer():
    sources = {"a": "def step_costs(lm):\n    pass", "b": "class StepCost:\n    pass",
               "c": "def tree_step_seconds(lm):\n    pass\nx = step_cost(lm)"}
    assert step_timers(sources) == {"a", "b"}


def test_one_step_cost_timer_in_engine():
    sources = {".".join(path.relative_to(ROOT).with_suffix("").parts): path.read_text()
               for path in (ROOT / "engine").rglob("*.py")}
    assert step_timers(sources) == {"engine.decode.timing"}
