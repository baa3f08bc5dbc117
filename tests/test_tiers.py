"""The rules of tests/conftest.py: exactly one of unit, oracle, e2e per test, and no unit test
that asks for the rank pool (collection fails otherwise); under CI, a test skipped for a missing
input fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import TIERS, tier_problems

pytestmark = pytest.mark.unit


def _item(*markers: str, fixtures: tuple[str, ...] = ()) -> SimpleNamespace:
    marks = [getattr(pytest.mark, name).mark for name in markers]
    return SimpleNamespace(
        nodeid=f"t[{','.join(markers)}]", iter_markers=lambda: iter(marks), fixturenames=fixtures
    )


def test_exactly_one_tier_passes():
    assert tier_problems([_item(t) for t in TIERS]) == []
    assert tier_problems([_item("oracle", "parametrize", fixtures=("dist_pool",))]) == []


@pytest.mark.parametrize(
    "item, why",
    [
        (_item(), "tiers none"),
        (_item("skipif"), "tiers none"),
        (_item("unit", "e2e"), "tiers ['e2e', 'unit']"),
        (_item("unit", fixtures=("tmp_path", "dist_pool")), "uses the rank pool"),
    ],
)
def test_untiered_or_mistiered_tests_are_named(item, why):
    (problem,) = tier_problems([item])
    assert problem.startswith(item.nodeid) and why in problem, problem


def test_every_collected_test_of_this_file_is_unit(request):
    assert request.node.get_closest_marker("unit") is not None


_MISSING_INPUTS = """
import pytest
from helpers.inputs import needs_input, skip_missing

pytestmark = pytest.mark.unit


@needs_input(False, "SOME_SOURCE is not set")
def test_marked():
    pass


def test_skipped_inside():
    skip_missing("SOME_TESTS is not set")


@pytest.mark.skipif(True, reason="another reason: not an input")
def test_other_skip():
    pass
"""


@pytest.mark.parametrize("ci", ["", "true"])
def test_a_missing_input_skips_but_fails_under_ci(tmp_path, ci):
    """``helpers.inputs``: a test skipped for a missing input fails when ``CI`` is set (a green
    CI means it ran); another skip stays a skip."""
    root = Path(__file__).resolve().parents[1]
    (tmp_path / "test_inputs_probe.py").write_text(_MISSING_INPUTS)
    env = {**os.environ, "CI": ci}
    argv = [sys.executable, "-m", "pytest", "-q", "-rfs", "-p", "conftest", "-p",
            "no:cacheprovider", "--rootdir", str(root), "-c", str(root / "pyproject.toml"),
            "-n", "0", str(tmp_path / "test_inputs_probe.py")]  # fmt: skip
    out = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    if ci:
        # A skip mark fails the test at its setup (pytest counts it an error), a skip inside it
        # at its call.
        assert out.returncode == 1 and "1 failed, 1 skipped, 1 error" in text, text[-3000:]
        assert "CI lacks an input this test needs: SOME_SOURCE is not set" in text, text[-3000:]
        assert "CI lacks an input this test needs: SOME_TESTS is not set" in text, text[-3000:]
    else:
        assert out.returncode == 0 and "3 skipped" in text, text[-3000:]


def test_a_missing_stack_is_a_missing_input_in_its_own_virtualenv_only(monkeypatch):
    """CI runs a stack's tests in the virtualenv its page makes (``.venv-<stack>``): there the
    stack missing fails under CI; in another world (``pytest -m unit`` collects the stack's
    unit tests there too) it is a plain skip."""
    from helpers.inputs import MISSING, needs_stack

    monkeypatch.setattr(sys, "prefix", "/clone/.venv-slime")
    assert needs_stack(False, "slime", "slime").kwargs["reason"] == MISSING + "slime"
    assert needs_stack(False, "verl", "verl").kwargs["reason"] == "verl"
    assert needs_stack(True, "slime", "slime").args == (False,)
