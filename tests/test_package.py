"""The package's public surface: what docs/design.md §5 names, and an import that stays cheap."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import megatron_lossfix

pytestmark = pytest.mark.unit


def test_the_version_is_written_once():
    """setup.py reads ``__version__`` from the package; pyproject.toml states none."""
    repo = Path(__file__).resolve().parents[1]
    assert re.fullmatch(r"\d+\.\d+\.\d+", megatron_lossfix.__version__)
    assert megatron_lossfix.__version__ not in (repo / "setup.py").read_text()
    pyproject = tomllib.loads((repo / "pyproject.toml").read_text())
    assert "version" not in pyproject.get("project", {})
    metadata = subprocess.run(
        [sys.executable, "setup.py", "--version"], cwd=repo, capture_output=True, text=True
    )
    assert metadata.stdout.strip().splitlines()[-1] == megatron_lossfix.__version__


def test_public_api_is_declared_and_importable():
    for name in megatron_lossfix.__all__:
        assert hasattr(megatron_lossfix, name), name


def test_loss_weights_signature_is_the_contract():
    params = inspect.signature(megatron_lossfix.loss_weights).parameters
    contract = ["loss_masks", "reduction", "norm_constant", "dp_group", "cp_group"]
    assert list(params)[:5] == contract
    assert all(params[p].kind is inspect.Parameter.KEYWORD_ONLY for p in list(params)[2:])
    assert all(params[p].default is None for p in contract[2:])
    # Beyond the contract: rank-local weights on several ranks only when asked for.
    # Keyword-only additions (the group modes' ids; rank-local weights on several ranks only when
    # asked for) keep every contract call working.
    extra = ["group_ids", "num_groups", "trajectory_ids", "num_trajectories", "pair_ids"]
    extra.append("rank_local")
    assert list(params)[5:] == extra and params["rank_local"].default is False


def test_importing_the_package_does_not_import_megatron():
    code = (
        "import sys, megatron_lossfix; print(any(m.startswith('megatron.') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_contract_names_are_top_level():
    """What outside harnesses import (docs/design.md §5): no internal module path needed."""
    for name in ("REDUCTIONS", "loss_weights", "LossFixConfig", "LossFixSchedule",
                 "enable_cpu_megatron", "slice_batch_for_cp", "StepRefused", "SelfCheckError",
                 "weighted_loss", "add_lossfix_args", "schedule_from_args"):  # fmt: skip
        assert name in megatron_lossfix.__all__, name
    assert (
        megatron_lossfix.enable_cpu_megatron.__module__ == "megatron_lossfix.harness.cpu_megatron"
    )


@pytest.mark.parametrize(
    "module, name",
    [
        ("megatron_lossfix.args", "from_args"),
        ("megatron_lossfix.runtime.losses", "weighted_sum"),
        ("megatron_lossfix.rl.objective", "scale_advantages"),
        ("megatron_lossfix.rl.objective", "rl_loss"),
    ],
)
def test_names_off_the_top_level_stay_in_their_modules(module, name):
    """What left the top level is imported from its module, as CHANGELOG.md's migration lines
    say."""
    assert name not in megatron_lossfix.__all__
    assert callable(getattr(importlib.import_module(module), name))


def test_the_api_reference_covers_every_public_name():
    """docs/api.md documents each name of ``__all__``, and each has a docstring (the docs hook
    that fails ``mkdocs build --strict`` otherwise, run here without mkdocs)."""
    repo = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("public_api", repo / "docs/hooks/public_api.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    names = hook.public_names()
    assert list(names) == list(megatron_lossfix.__all__)
    page = (repo / "docs" / "api.md").read_text()
    for name, module in names.items():
        assert f"::: megatron_lossfix.{name}" in page, name
        assert hook.has_docstring(module, name), f"{module}.{name}"
        assert getattr(importlib.import_module(module), name) is getattr(megatron_lossfix, name)


#: Sphinx's cross-reference roles, which mkdocstrings prints as they are (docs/api.md).
SPHINX_ROLE = re.compile(r":(?:func|meth|class|data|attr|mod|exc|obj|const):`[^`]*`")


def _api_docstrings() -> dict[str, str]:
    """``"module.name: line"`` -> the text of every docstring the API page renders: each public
    name's, and for a class or function every docstring inside it (methods, properties, the
    strings under its attributes), read from the source as mkdocstrings reads it."""
    repo = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("public_api", repo / "docs/hooks/public_api.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    out = {}
    for name, module in hook.public_names().items():
        body = ast.parse((repo / (module.replace(".", "/") + ".py")).read_text()).body
        for i, node in enumerate(body):
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name == name:
                strings = [n.value for n in ast.walk(node) if isinstance(n, ast.Expr)]
            elif any(getattr(t, "id", None) == name for t in getattr(node, "targets", ())):
                strings = [n.value for n in body[i + 1 : i + 2] if isinstance(n, ast.Expr)]
            else:
                continue
            for string in strings:
                if isinstance(string, ast.Constant) and isinstance(string.value, str):
                    out[f"{module}.{name}: {string.lineno}"] = string.value
    return out


def test_the_api_pages_docstrings_hold_no_sphinx_roles():
    """mkdocstrings renders markdown: a Sphinx role (:func:`x`) would show as raw text on the
    API page. Cross-references there are ``[x][megatron_lossfix.x]`` or plain backticks."""
    docstrings = _api_docstrings()
    assert len(docstrings) > len(megatron_lossfix.__all__)  # members' docstrings too
    found = {where: SPHINX_ROLE.findall(text) for where, text in docstrings.items()}
    found = {where: roles for where, roles in found.items() if roles}
    assert not found, found


def test_the_site_publishes_pages_not_the_builds_code():
    """mkdocs publishes every file under docs/ that ``exclude_docs`` does not name: the build's
    hooks (Python files beside the pages) must be among those it names."""
    repo = Path(__file__).resolve().parents[1]
    config = (repo / "mkdocs.yml").read_text()
    block = re.search(r"^exclude_docs: \|\n((?:  .*\n)+)", config, re.M)
    excluded = block[1].split() if block else []
    docs = repo / "docs"
    code = [p.relative_to(docs).as_posix() for p in docs.rglob("*.py")]
    assert code, "the docs hook moved: update this test"
    published = [p for p in code if not any(p.startswith(folder) for folder in excluded)]
    assert not published, f"mkdocs.yml's exclude_docs does not name {published}"


def _ruff(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


#: What the project's lint covers (pyproject.toml's ruff ``include``).
PROJECT_FILES = ("megatron_lossfix/", "tests/", "examples/", "docs/", "noxfile.py", ".ci/",
                 "setup.py", "pyproject.toml")  # fmt: skip


def test_lint_checks_the_projects_own_files_only(tmp_path):
    """``ruff check .`` (nox's lint) lints the project's files, not a Megatron-LM tree or a
    virtualenv unpacked into the clone: with the project's ruff settings, a stray tree beside
    the package is not checked; in this clone, every file ruff checks is the project's."""
    repo = Path(__file__).resolve().parents[1]
    (tmp_path / "pyproject.toml").write_text((repo / "pyproject.toml").read_text())
    # A repository of its own: ruff honours the .gitignore of a repository above it, and pytest's
    # temporary folder may lie in an ignored folder of a clone (under nox: .nox/).
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    for path in ("megatron_lossfix/ok.py", "Megatron-LM-core_v0.16.1/megatron/bad.py"):
        (tmp_path / path).parent.mkdir(parents=True)
    (tmp_path / "megatron_lossfix" / "ok.py").write_text("X = 1\n")
    (tmp_path / "Megatron-LM-core_v0.16.1" / "megatron" / "bad.py").write_text("import os\nx=1\n")
    listed = _ruff("check", "--show-files", ".", cwd=tmp_path)
    files = {Path(line).relative_to(tmp_path).as_posix() for line in listed.stdout.split()}
    assert files == {"megatron_lossfix/ok.py", "pyproject.toml"}, listed.stdout
    assert _ruff("check", ".", cwd=tmp_path).returncode == 0
    assert _ruff("format", "--check", ".", cwd=tmp_path).returncode == 0
    listed = _ruff("check", "--show-files", ".", cwd=repo)
    files = [Path(line).relative_to(repo).as_posix() for line in listed.stdout.split()]
    assert files and all(f.startswith(PROJECT_FILES) for f in files), files


@pytest.mark.parametrize("old", sorted(megatron_lossfix.MOVED_MODULES))
def test_a_moved_modules_old_address_still_imports_with_a_warning(old):
    """One release of grace for imports written before the runtime moved into its folders."""
    new = importlib.import_module(megatron_lossfix.MOVED_MODULES[old])
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new.__name__}"):
        module = importlib.import_module(old)
    assert module is new
    assert not any(m.startswith(f"{old}.") for m in megatron_lossfix.MOVED_MODULES)


def test_the_step_classes_old_address_still_imports_with_a_warning():
    from megatron_lossfix.step.driver import Step

    with pytest.warns(DeprecationWarning, match="megatron_lossfix.step.Step moved"):
        from megatron_lossfix.step import Step as old

    assert old is Step


#: Each framework's folder under ``integrations/`` and the module whose names it serves.
SERVED = {"megatron_lm": "training", "bridge": "adapter", "verl": "adapter", "skyrl": "adapter",
          "slime": "adapter", "areal": "adapter", "roll": "adapter",
          "ms_swift": "adapter", "nemo_rl": "adapter"}  # fmt: skip

#: Run in a fresh interpreter, so that the folders' packages and their modules are imported here
#: and nowhere before: the package's attribute is read first (the first read imports the module),
#: every warning on the way is recorded, and the module is imported by its own name last.
_SERVE_PROBE = """
import importlib, json, sys, warnings
served, documented = json.loads(sys.argv[1]), json.loads(sys.argv[2])
out = {"missing": [], "other": [], "unknown": [], "documented": [], "warnings": []}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for framework, module in served.items():
        package = importlib.import_module(f"megatron_lossfix.integrations.{framework}")
        names, lazy = {}, []
        for name in importlib.import_module(package.__name__ + "." + module).__all__:
            try:
                names[name] = getattr(package, name)
            except AttributeError:
                out["missing"].append(f"{framework}.{name}")
            except ImportError:  # made on use from a framework not installed here
                lazy.append(name)
        module = importlib.import_module(f"{package.__name__}.{module}")
        out["other"] += [f"{framework}.{n}" for n, v in names.items()
                         if v is not getattr(module, n)]
        for name in lazy:
            try:
                getattr(module, name)
                out["other"].append(f"{framework}.{name}: the module serves it, the folder not")
            except ImportError:
                pass
        try:
            package.no_such_name
        except AttributeError as e:
            if "no_such_name" not in str(e):
                out["unknown"].append(f"{framework}: {e}")
        else:
            out["unknown"].append(f"{framework}: no_such_name was served")
    for address in documented:
        package, _, name = address.rpartition(".")
        try:
            getattr(importlib.import_module(package), name)
        except (ImportError, AttributeError) as e:
            out["documented"].append(f"{address}: {e}")
out["warnings"] = [str(w.message) for w in caught if "megatron_lossfix" in str(w.message)
                   or "megatron_lossfix" in w.filename]
print(json.dumps(out))
"""


def _documented_served_addresses() -> list[str]:
    """``megatron_lossfix.integrations.<framework>.<name>`` as the README, the pages and the
    patches write it, where ``<name>`` is a served name (not a module of the folder)."""
    repo = Path(__file__).resolve().parents[1]
    pattern = re.compile(r"megatron_lossfix\.integrations\.(\w+)\.(\w+)")
    texts = [repo / "README.md", *(repo / "docs").glob("*.md"), *(repo / "patches").glob("*")]
    found = set()
    for text in texts:
        for framework, name in pattern.findall(text.read_text()):
            folder = repo / "megatron_lossfix" / "integrations" / framework
            if not (folder / f"{name}.py").exists() and not (folder / name).is_dir():
                found.add(f"megatron_lossfix.integrations.{framework}.{name}")
    return sorted(found)


def test_a_frameworks_folder_serves_its_adapters_names_without_a_warning():
    """``integrations.<framework>`` was the adapter's module and is its folder now: every name of
    the adapter's ``__all__`` (``training``'s for Megatron-LM, which the patched trees read), and
    every such address the README, the pages and the patches write, is served there, the same
    object, with no warning of ours; a name the module lacks is an AttributeError naming it."""
    repo = Path(__file__).resolve().parents[1]
    integrations = repo / "megatron_lossfix" / "integrations"
    folders = {p.parent.name for p in integrations.glob("*/__init__.py")}
    assert folders == set(SERVED), "a framework folder was added or removed: update SERVED"
    documented = _documented_served_addresses()
    assert "megatron_lossfix.integrations.slime.enable" in documented  # the reading still works
    run = subprocess.run(
        [sys.executable, "-c", _SERVE_PROBE, json.dumps(SERVED), json.dumps(documented)],
        capture_output=True, text=True, cwd=repo, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.splitlines()[-1])
    assert out == {"missing": [], "other": [], "unknown": [], "documented": [], "warnings": []}
