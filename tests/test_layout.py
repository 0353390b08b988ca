"""The layers' directions (docs/architecture.md): trainjobs ← service ← worker, and worker/train on trainjobs only.

- the public `trainjobs` package imports neither the control plane, the data plane, SQLAlchemy nor torch;
- the control plane never imports torch or worker/ (it starts fast and stays slim);
- the worker changes state through service.jobs.lifecycle and reads through the domains' services, never
  through the ORM models;
- a training rank loads no SQLAlchemy and no control plane: checked in a real rank, after it trained.
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import mlp_spec
from tests.helpers import run_torchrun

ROOT = Path(__file__).resolve().parent.parent


def loaded_after_importing(packages: list[str]) -> set[str]:
    """The top-level names in sys.modules after a fresh interpreter imports every module of `packages`."""
    code = (
        "import importlib, pkgutil, sys\n"
        f"for name in {packages!r}:\n"
        "    pkg = importlib.import_module(name)\n"
        "    for info in pkgutil.walk_packages(pkg.__path__, name + '.'):\n"
        "        if not info.name.endswith('__main__'):  # a command, not a module to import\n"
        "            importlib.import_module(info.name)\n"
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return set(out.stdout.split())


def imports_of(folder: str) -> dict[str, set[str]]:
    """Every module each file of `folder` imports, read from its source (imports inside functions too)."""
    found = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)
        found[str(path.relative_to(ROOT))] = names
    return found


def test_the_public_package_imports_neither_service_worker_sqlalchemy_nor_torch():
    loaded = loaded_after_importing(["trainjobs"])
    assert "trainjobs" in loaded
    assert loaded & {"service", "worker", "sqlalchemy", "torch", "numpy", "redis", "rq"} == set()


def test_the_control_plane_imports_neither_torch_nor_worker():
    loaded = loaded_after_importing(["service"])
    assert "service" in loaded and "sqlalchemy" in loaded
    assert loaded & {"torch", "worker", "numpy"} == set()


def test_the_worker_agent_does_not_import_torch():
    """The RQ job function runs in a fresh work-horse per job: torch there would add seconds per claim."""
    code = "import sys, worker.agent, worker.main\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_worker_reaches_no_table_but_through_the_control_plane_s_functions():
    offenders = {path: sorted(n for n in names if n.startswith("service.") and n.split(".")[-1] == "models"
                              or n == "service.models")
                 for path, names in imports_of("worker").items()}
    assert {p: n for p, n in offenders.items() if n} == {}


def test_the_training_runtime_imports_only_trainjobs_of_ours():
    offenders = {path: sorted(n for n in names if n.split(".")[0] in ("service", "sqlalchemy", "redis", "rq"))
                 for path, names in imports_of("worker/train").items()}
    assert {p: n for p, n in offenders.items() if n} == {}


def test_a_real_training_rank_loads_no_sqlalchemy_and_no_control_plane(tmp_path, monkeypatch):
    out = tmp_path / "modules"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests" / "rank_probe"), str(ROOT)]))
    monkeypatch.setenv("TRAINJOBS_TEST_MODULES_OUT", str(out))
    records = run_torchrun(mlp_spec(train={"max_steps": 2, "log_every": 1}), tmp_path / "run")
    assert any(r["type"] == "summary" for r in records)  # it trained to the end
    for rank in (0, 1):
        modules = set((tmp_path / f"modules.{rank}").read_text().split())
        assert {"torch", "worker.train.main", "trainjobs.runenv"} <= modules
        assert {m for m in modules if m.split(".")[0] in ("sqlalchemy", "service", "redis", "rq", "psycopg")} == set()


# The control plane's own order, bottom → top (docs/architecture.md, "Layers inside service/"). A module imports
# only what sits below its package, with two tiers across the packages: every domain's tables (`models.py`) sit
# under all the domains' logic, so any module may read any table; and every `router.py` sits above all of it,
# below the app (`api/`), which assembles the routers. The bottom modules (`deps.py` among them) import no domain.
ORDER = ["errors", "redis_auth", "settings", "db", "lists", "deps", "undumpable", "jobfiles", "storage",  # bottom
         "auth", "packages", "webhooks", "logs", "workers", "scheduling", "jobs", "metrics",  # domains
         "runners", "images", "sweeps", "artifacts", "dashboard",  # (the worker protocol's calls use those below)
         "models", "migrate", "api", "cli"]  # every table for Alembic; the schema's upgrades; the processes
DOMAINS = ORDER[ORDER.index("auth"):ORDER.index("models")]


def runtime_imports(path: Path) -> set[str]:
    """The service modules `path` imports when it runs (imports inside functions too; not `if TYPE_CHECKING:`)."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.update(f"{node.module}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {n for n in names if n.startswith("service.")}


def service_modules() -> dict[str, Path]:
    """Every module of service/ by its dotted name (a package by its own name)."""
    found = {}
    for path in sorted((ROOT / "service").rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Module → the service modules it imports (`from service.jobs import queue` names service.jobs.queue)."""
    modules = service_modules()

    def module_of(name: str) -> str:
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    return {name: {module_of(n) for n in runtime_imports(path)} - {name, "service"}
            for name, path in modules.items()}


def package_of(module: str) -> str:
    return module.split(".")[1]


def kind_of(module: str) -> str:
    """'table', 'router' or 'logic': the tier a domain package's module sits in."""
    last = module.rsplit(".", 1)[-1]
    return {"models": "table", "router": "router"}.get(last, "logic") if package_of(module) in DOMAINS else "logic"


def may_import(importer: str, imported: str) -> bool:
    here, there = package_of(importer), package_of(imported)
    if here == there:
        return True
    if kind_of(importer) == "table":  # a table names the database's types and other tables, nothing more
        return ORDER.index(there) <= ORDER.index("db") or kind_of(imported) == "table"
    if kind_of(imported) == "router":  # only the app assembles the routers
        return here in ("api", "models", "migrate", "cli") and ORDER.index(here) > ORDER.index(there)
    if kind_of(imported) == "table":
        return True
    if kind_of(importer) == "router":  # a route may call any domain's logic, never the app's modules
        return ORDER.index(there) < ORDER.index("models")
    return ORDER.index(there) < ORDER.index(here)


def test_every_service_package_has_its_place_in_the_order():
    assert {package_of(m) for m in service_modules() if m != "service"} == set(ORDER)


def test_the_service_packages_import_only_what_sits_below_them():
    offenders = sorted(f"{a} → {b}" for a, imported in import_graph().items() if a != "service"
                       for b in imported if not may_import(a, b))
    assert offenders == []


def test_no_import_cycle_crosses_two_service_packages():
    """Tarjan's strongly connected components of the module graph: one spanning two packages is a cycle between
    them, however lazily one of its imports is made (a function-level import only hides it until it runs)."""
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len({package_of(m) for m in component if m != "service"}) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == []
