"""The documentation site (mkdocs.yml, docs/) and the README.

The site builds with --strict (a broken link, a missing anchor or a page outside the nav fails); the Reference,
generated from the code (docs/gen_reference.py), has an entry for every setting, spec field, route, command,
Prometheus metric and error type the code has, counted here from the code itself; generating it imports no
torch; the README stays a one-minute start whose commands are the Makefile's.
"""

import importlib.util
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
MAKEFILE = (ROOT / "Makefile").read_text()


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return load_generator().generate(ROOT / "docs")


def test_the_site_builds_with_strict_and_search_finds_settings_and_pending_jobs(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("MkDocs and Material are not installed: pip install -e '.[docs]' (make test installs them)")
    site = tmp_path / "site"
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", "mkdocs.yml",
                          "--site-dir", str(site)], cwd=ROOT, capture_output=True, text=True, timeout=180,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "TRAINJOBS_LEASE_S" in (site / "reference" / "settings" / "index.html").read_text()
    assert (site / "architecture" / "index.html").is_file()  # docs/architecture.md, as it is
    assert "Benchmarks" in (site / "architecture" / "performance" / "index.html").read_text()  # bench/README.md
    index = (site / "search" / "search_index.json").read_text()
    assert "TRAINJOBS_LEASE_S" in index
    assert "Why is my job pending" in index


def test_the_build_fails_on_a_broken_link_or_anchor():
    """--strict turns MkDocs' warnings into failures: the checks that warn are those a reader trips on."""
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)  # BaseLoader: no !tags
    assert config["strict"] == "true"
    for check in ("omitted_files", "absolute_links", "unrecognized_links", "anchors"):
        assert config["validation"][check] == "warn", check
    assert "search" in config["plugins"]
    assert "--strict" in MAKEFILE.split("docs-build:")[1].split("\n\n")[0]


def test_generating_the_reference_imports_no_torch():
    code = ("import importlib.util, sys\n"
            "spec = importlib.util.spec_from_file_location('g', 'docs/gen_reference.py')\n"
            "g = importlib.util.module_from_spec(spec); spec.loader.exec_module(g); g.generate()\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_every_setting_is_in_the_settings_reference(pages):
    from service.settings import Settings

    page = pages["reference/settings.md"]
    missing = [f"TRAINJOBS_{name.upper()}" for name in Settings.model_fields
               if f"`TRAINJOBS_{name.upper()}`" not in page]
    assert not missing
    assert len(Settings.model_fields) > 50  # the count is the code's, not a copy of it
    assert "`TRAINJOBS_LEASE_S`" in page


def models_in(annotation) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds: itself, in a union, an Optional, an Annotated."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in models_in(arg)]


def spec_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every field's dotted path, into sections, the variants of a union and the values of a dict."""
    paths = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        paths.append(path)
        annotation, key = field.annotation, ""
        if typing.get_origin(annotation) is dict:
            annotation, key = typing.get_args(annotation)[1], ".<key>"
        for inner in models_in(annotation):
            if inner.__name__ != "JobSpec":  # a sweep's base spec: the job spec's own section
                paths += spec_paths(inner, f"{path}{key}.")
    return paths


def test_every_spec_field_is_in_the_job_spec_reference(pages):
    from trainjobs.spec import JobSpec
    from trainjobs.sweep import SweepSpec

    page = pages["reference/job-spec.md"]
    job, sweep = page.split("# Sweep spec reference")
    paths = spec_paths(JobSpec)
    assert {"resources.nproc_per_node", "model.n_layer", "data.path", "train.checkpoint_every", "env"} <= set(paths)
    assert [p for p in paths if f"| `{p}` |" not in job] == []
    sweep_paths = spec_paths(SweepSpec)
    assert "parameters.<key>.distribution" in sweep_paths
    assert [p for p in sweep_paths if f"| `{p}` |" not in sweep] == []


def test_every_route_is_in_the_rest_reference(pages, tmp_path):
    from service.api.app import create_app
    from service.settings import Settings

    app = create_app(Settings(data_dir=tmp_path / "data", secrets_dir=tmp_path / "secrets",
                              database_url=f"sqlite:///{tmp_path}/db.sqlite", redis_password_file=None))
    routes = [(method.upper(), path) for path, item in app.openapi()["paths"].items() for method in item
              if method in {"get", "post", "put", "patch", "delete", "head"}]
    app.state.engine.dispose()
    assert len(routes) > 30
    page = pages["reference/rest-api.md"]
    assert [r for r in routes if f"### `{r[0]} {r[1]}`" not in page] == []


def test_every_cli_command_is_in_the_cli_reference(pages):
    import argparse

    from service.cli.main import build_parser

    def commands(parser, prefix):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield f"{prefix} {name}"
                    yield from commands(sub, f"{prefix} {name}")

    found = list(commands(build_parser(), "trainjobs"))
    assert {"trainjobs submit", "trainjobs webhooks create", "trainjobs token revoke"} <= set(found)
    page = pages["reference/cli.md"]
    assert [c for c in found if f"`{c}` {{#" not in page] == []


def test_every_prometheus_metric_is_in_the_metrics_reference(pages):
    source = (ROOT / "service" / "api" / "prometheus.py").read_text()
    names = sorted(set(re.findall(r"\"(trainjobs_[a-z_]+)\"", source)))
    assert len(names) >= 12
    page = pages["reference/prometheus.md"]
    assert [n for n in names if f"| `{n}" not in page] == []
    assert len(re.findall(r"^\| `trainjobs_", page, re.M)) == len(names)


def test_every_error_type_is_in_the_reference_and_in_troubleshooting(pages):
    from trainjobs.states import ErrorType

    troubleshooting = (ROOT / "docs" / "operations" / "troubleshooting.md").read_text()
    assert [e.value for e in ErrorType if f"| `{e.value}` |" not in pages["reference/errors.md"]] == []
    assert [e.value for e in ErrorType if f"| `{e.value}` |" not in troubleshooting] == []
    assert "## Why is my job pending" in troubleshooting


def test_the_readme_is_a_quick_start_of_at_most_150_lines():
    assert len(README.splitlines()) <= 150
    for link in re.findall(r"\]\(((?:docs|bench)/[^)#]+)", README):
        assert (ROOT / link).is_file(), link


def test_the_readme_quick_start_is_what_the_makefile_does():
    block = README.split("## Two commands", 1)[1].split("```")[1]
    targets = re.findall(r"^make (\w[\w-]*)", block, re.M)
    assert targets == ["demo", "test"]
    for target in targets:
        assert re.search(rf"^{target}:", MAKEFILE, re.M), target
    demo = MAKEFILE.split("\ndemo:", 1)[1].split("\n\n")[0]
    assert "examples/ddp-mlp.json" in demo and "examples/ddp-mlp.json" in block
    torch = re.search(r"^TORCH\s+\?=\s*(\S+)", MAKEFILE, re.M).group(1)
    assert f'make TORCH="{torch} --index-url' in README
    assert "pip install -q -e '.[worker,dev,docs,frameworks]'" in MAKEFILE
    assert "`worker`, `dev`, `docs` and `frameworks` extras" in README
    assert "scripts/ensure-services.sh" in MAKEFILE.split("\nservices:", 1)[1].split("\n\n")[0]  # "makes sure ... up"
