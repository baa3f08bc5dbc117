"""The tier rule of tests/conftest.py: exactly one of unit, oracle, e2e per test, and no unit test
that asks for the rank pool (collection fails otherwise)."""

from __future__ import annotations

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
