"""``helpers.own_tests``, the one way the stacks' tests run a framework's own tests with an adapter
on: its counts of what ran, what a stack's plugin reports at the end, and the check that asks
for no failure and at least N passed. Run here on a stand-in framework, so that the helper is
checked where slime or AReaL is not installed."""

from __future__ import annotations

import pytest
from helpers import own_tests

pytestmark = pytest.mark.unit

#: The stand-in framework's tests: two pass, one is skipped, and one fails when ``FAIL`` is set.
_TESTS = """
import os
import pytest


def test_one():
    import stand_in_plugin
    stand_in_plugin.CALLS["hook"] += 1


def test_two():
    assert True


@pytest.mark.skip(reason="not here")
def test_skipped():
    pass


def test_maybe_failing():
    assert not os.environ.get("FAIL")
"""

#: The stand-in stack's plugin: it "switches the adapter on" and reports its hook's calls.
_PLUGIN = """
from helpers import own_tests

CALLS = {"hook": 0}


def pytest_configure(config):
    own_tests.report_at_end(lambda: {"adapter": "on", "hook_calls": dict(CALLS)})
"""


def _framework(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_stand_in.py").write_text(_TESTS)
    (tmp_path / "stand_in_plugin.py").write_text(_PLUGIN)
    return tmp_path / "tests"


def test_a_clean_run_counts_what_ran_and_what_the_plugin_reports(tmp_path, monkeypatch):
    monkeypatch.delenv("FAIL", raising=False)
    run = own_tests.run_own_tests(_framework(tmp_path), ["test_stand_in.py"], "stand_in_plugin")
    assert run.counts == {"passed": 3, "failed": 0, "errors": 0, "skipped": 1}, run.output
    assert run.report["adapter"] == "on" and run.report["hook_calls"] == {"hook": 1}
    run.check(at_least=3)
    with pytest.raises(AssertionError, match="want at least 4 passed"):
        run.check(at_least=4)


def test_a_failure_fails_the_check_whatever_passed(tmp_path, monkeypatch):
    monkeypatch.setenv("FAIL", "1")
    run = own_tests.run_own_tests(_framework(tmp_path), ["test_stand_in.py"], "stand_in_plugin")
    assert run.counts == {"passed": 2, "failed": 1, "errors": 0, "skipped": 1}, run.output
    with pytest.raises(AssertionError, match="'failed': 1"):
        run.check(at_least=2)


def test_a_file_that_does_not_collect_is_an_error(tmp_path):
    tests = _framework(tmp_path)
    (tests / "test_broken.py").write_text("import no_such_module_here\n")
    run = own_tests.run_own_tests(tests, ["test_broken.py"], "stand_in_plugin")
    assert run.counts["errors"] == 1 and run.counts["passed"] == 0, run.output
    with pytest.raises(AssertionError):
        run.check(at_least=0)
