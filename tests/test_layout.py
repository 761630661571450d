"""The layout of docs/design.md §10, checked on the import graph (grimp, the library behind
``lint-imports``, which checks the one-way order in ``make lint``).

A package's private modules (``_name.py``) and private names are its own: another package reaches
it through its public modules. The top level's private modules (``trimkit._calibration``, …) serve
the top level only.
"""

from __future__ import annotations

import ast
import pathlib

import grimp
import pytest

PACKAGES = ("planning", "backends", "fleet", "integrations")
ROOT = pathlib.Path(__file__).resolve().parent.parent / "trimkit"


def room(module: str) -> str:
    """The package a module belongs to: ``trimkit.<package>``, or ``trimkit`` for the top level."""
    parts = module.split(".")
    return f"trimkit.{parts[1]}" if len(parts) > 1 and parts[1] in PACKAGES else "trimkit"


def private_part(module: str, importer: str) -> str | None:
    """The first private (``_name``) part of ``module`` below what ``importer`` may see, if any."""
    for part in module.split(".")[1:]:
        if part.startswith("_") and not part.startswith("__"):
            return part
    return None


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("trimkit", include_external_packages=True)


def test_no_package_reaches_into_another_packages_private_modules(graph):
    crossings = []
    for importer in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(importer):
            if room(importer) != room(imported) and private_part(imported, importer):
                crossings.append(f"{importer} -> {imported}")
    assert crossings == []


def test_the_check_sees_a_crossing():
    """The rule above, on an import it must refuse and one it must allow."""
    assert room("trimkit.planning.solver") != room("trimkit._calibration") and private_part("trimkit._calibration", "")
    assert room("trimkit.fleet") == room("trimkit.fleet") and private_part("trimkit.fleet", "") is None


def private_names_imported(path: pathlib.Path) -> list[tuple[str, str]]:
    """``(module, name)`` for every ``from trimkit… import _name`` in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trimkit"):
            found += [(node.module, a.name) for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_private_name_is_imported_from_another_package():
    crossings = []
    for path in ROOT.rglob("*.py"):
        importer = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
        for module, name in private_names_imported(path):
            if room(module) != room(importer):
                crossings.append(f"{importer}: from {module} import {name}")
    assert crossings == []


def test_planning_imports_no_engine_no_http_and_no_store(graph):
    """The pure core: what it imports, everything it imports imports too (``lint-imports``
    checks the same with a named contract; this one runs in the unit tests)."""
    reached = graph.find_upstream_modules("trimkit.planning", as_package=True)
    assert not {m for m in reached if m.split(".")[0] in {"llama_cpp", "httpx", "openai", "ollama", "platformdirs"}}
    assert not {m for m in reached if room(m) in {"trimkit.backends", "trimkit.fleet", "trimkit.integrations"}}


#: the namespaces docs/reference.md documents: only these say (``__all__``) what they export
DOCUMENTED = {"trimkit", "trimkit.strategies", "trimkit.errors", "trimkit.backends", "trimkit.testing", "trimkit.otel",
              "trimkit.metrics", "trimkit.fleet", "trimkit.openai_wrapper", "trimkit.planning", "trimkit.planning.summaries",
              "trimkit.integrations.langchain", "trimkit.integrations.llamaindex"}


def test_only_the_documented_namespaces_declare_what_they_export():
    declaring = set()
    for path in ROOT.rglob("*.py"):
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in n.targets) for n in tree.body):
            declaring.add(".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__"))
    assert declaring <= DOCUMENTED, sorted(declaring - DOCUMENTED)
    assert {"trimkit", "trimkit.errors", "trimkit.strategies", "trimkit.backends"} <= declaring


def trimkit_imports(path: pathlib.Path) -> list[tuple[int, str, str | None]]:
    """``(line, module, name)`` for every import of trimkit in a file, those inside functions too
    (``name`` None for ``import trimkit.x``), less those marked as an earlier commit's."""
    found: list[tuple[int, str, str | None]] = []
    text = path.read_text()
    lines = text.splitlines()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import | ast.ImportFrom) and "the old tree's" in lines[node.lineno - 1]:
            continue  # a worker that imports trimkit as of an earlier commit (rag_answer_kept.py)
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "trimkit":
            found += [(node.lineno, node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] == "trimkit"]
    return found


def test_every_trimkit_import_in_benchmarks_examples_and_tests_resolves():
    """A module moved inside trimkit leaves no import behind in a script that imports it lazily
    (a benchmark's ``--model gemma`` branch imported ``trimkit.templates`` after it moved)."""
    import importlib

    repo = ROOT.parent
    broken = []
    for folder in ("benchmarks", "examples", "tests"):
        for path in sorted((repo / folder).rglob("*.py")):
            for line, module, name in trimkit_imports(path):
                try:
                    mod = importlib.import_module(module)
                except ModuleNotFoundError as e:
                    if e.name and e.name.split(".")[0] != "trimkit":
                        continue  # an optional engine or framework this environment lacks
                    broken.append(f"{path.relative_to(repo)}:{line} {module}")
                    continue
                if name is not None and name != "*" and not hasattr(mod, name):
                    try:
                        importlib.import_module(f"{module}.{name}")
                    except ModuleNotFoundError:
                        broken.append(f"{path.relative_to(repo)}:{line} {module}.{name}")
    assert broken == []
