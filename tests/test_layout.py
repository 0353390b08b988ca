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
