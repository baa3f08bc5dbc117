"""The step's metrics (megatron_lossfix.step.metrics) vs plain-PyTorch references written beside
them.

One rank, no process groups (``StepGroups`` of ``None``: nothing is communicated), so the
functions are pure: a step's record in, the step's numbers out. The references are
written from the rules in metrics.py's docstring, with explicit loops and no code shared with
the module (the step's counts come from ``count_tokens``, as the agreement's do). The
reductions over ranks themselves are covered by the layout tests (``tests/test_invariance.py``,
``tests/test_rl_invariance.py``).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_lossfix.runtime.config import LossFixConfig
from megatron_lossfix.runtime.process_groups import StepGroups
from megatron_lossfix.runtime.weights import count_tokens
from megatron_lossfix.step.driver import StepRecord
from megatron_lossfix.step.metrics import reduce_step_metrics, scalar_stats

pytestmark = pytest.mark.unit

NO_GROUPS = StepGroups(dp=None, cp=None, dp_cp=None, pp=None)
# Micro-batch masks of odd shapes; one holds no loss token, one row of another is empty.
MASK_SHAPES = [(3, 7), (1, 5), (2, 1), (4, 3)]


def make_masks(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    masks = [(torch.rand(s, generator=gen) < 0.5).float() for s in MASK_SHAPES]
    masks[0][1] = 0.0  # an empty sequence
    masks[2].zero_()  # a micro-batch without loss tokens
    masks[3][0, 0] = 1.0
    return masks


def make_reports(num: int, seed: int = 1) -> list:
    """RL-style reports: sums, counts, min and max, and entries metrics must leave out."""
    gen = torch.Generator().manual_seed(seed)
    reports = []
    for _ in range(num):
        r = lambda: torch.randn((), generator=gen, dtype=torch.float64).float()  # noqa: E731
        reports.append(
            {
                "pg_loss_sum": r(),
                "clip_low_count": r().abs().round(),
                "ratio_max": r(),
                "ratio_min": r().reshape(1),  # a one-element tensor counts as a scalar
                "num_tokens": r(),  # no known suffix: left out
                "lm loss": torch.stack([r(), r()]),  # no known suffix: left out
                "vector_sum": torch.randn(2, generator=gen),  # not one element: left out
                "python_sum": 1.5,  # not a tensor: left out
            }
        )
    reports.append(torch.zeros(()))  # a report that is not a mapping: skipped
    return reports


def ref_reduced_stats(reports: list) -> dict[str, float]:
    """sum of *_sum / *_count, max of *_max, min of *_min over the micro-batches' reports."""
    out: dict[str, float] = {}
    for report in reports:
        if not isinstance(report, dict):
            continue
        for key, value in report.items():
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                continue
            v = float(value.reshape(()))
            if key.endswith(("_sum", "_count")):
                out[key] = out.get(key, 0.0) + v
            elif key.endswith("_max"):
                out[key] = max(out.get(key, -math.inf), v)
            elif key.endswith("_min"):
                out[key] = min(out.get(key, math.inf), v)
    return out


def ref_counts(masks: list[torch.Tensor]) -> tuple[float, float]:
    """N (loss tokens) and S (sequences with at least one loss token), by loops."""
    tokens = sequences = 0
    for mask in masks:
        for row in mask.tolist():
            n = sum(1 for x in row if x != 0)
            tokens += n
            sequences += n > 0
    return float(tokens), float(sequences)


def state_for(
    reduction: str, masks: list[torch.Tensor], segments=None, per_token=False, **fields
) -> StepRecord:
    """A plugin mode's record on the loss stage: the counts as the agreement fills them in."""
    segments = segments or [(None, None)] * len(masks)
    counts = count_tokens(
        masks, segment_ids=[s for s, _ in segments], num_segments=[n for _, n in segments]
    )
    return StepRecord(
        config=LossFixConfig(reduction=reduction),
        num_microbatches=len(masks),
        pg_collection=None,
        groups=NO_GROUPS,
        model_config=SimpleNamespace(calculate_per_token_loss=per_token),
        counts=counts,
        **fields,
    )


def assert_metrics(got: dict, want: dict) -> None:
    assert set(got) == set(want), (sorted(got), sorted(want))
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key  # losses are fp32


def test_scalar_stats_keeps_one_element_tensors_with_a_known_suffix():
    reports = make_reports(3)
    stats = scalar_stats(reports)
    assert sorted(stats) == ["clip_low_count", "pg_loss_sum", "ratio_max", "ratio_min"]
    for key, values in stats.items():
        assert len(values) == 3
        for value, report in zip(values, reports, strict=False):
            assert value.dtype == torch.float64 and value.dim() == 0 and not value.requires_grad
            assert float(value) == float(report[key].reshape(()))


@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "sum"])
def test_plugin_mode_metrics_match_reference(reduction):
    masks = make_masks()
    gen = torch.Generator().manual_seed(5)
    # The plugin records each micro-batch's share of the loss, already normalized.
    contributions = [torch.randn((), generator=gen) for _ in masks]
    reports = make_reports(len(masks))
    state = state_for(reduction, masks, contributions=contributions, reports=reports)
    got = reduce_step_metrics(state)
    tokens, sequences = ref_counts(masks)
    want = {
        "loss": sum(float(c) for c in contributions),
        "num_tokens": tokens,
        "num_sequences": sequences,
        **ref_reduced_stats(reports),
    }
    assert_metrics(got, want)


def test_packed_sequences_are_counted_by_segment():
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0]])
    segments = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 3, 3]])  # segment 1 holds no loss token
    state = state_for("token_mean", [mask], [(segments, 4)], contributions=[torch.tensor(0.25)])
    got = reduce_step_metrics(state)
    assert_metrics(got, {"loss": 0.25, "num_tokens": 5.0, "num_sequences": 3.0})


def test_each_mtp_layer_reports_the_sum_of_its_shares():
    masks = make_masks()
    state = state_for("token_mean", masks, contributions=[torch.tensor(0.5)] * len(masks))
    shares = [[torch.tensor(0.25), torch.tensor(-0.125)], [torch.tensor(2.0)], []]
    state.mtp = SimpleNamespace(contributions=shares)  # metrics reads only the shares
    got = reduce_step_metrics(state)
    tokens, sequences = ref_counts(masks)
    want = {"loss": 0.5 * len(masks), "num_tokens": tokens, "num_sequences": sequences}
    want |= {f"mtp_loss_{j + 1}": sum(float(x) for x in layer) for j, layer in enumerate(shares)}
    assert_metrics(got, want)


def test_per_token_token_mean_divides_the_sum_by_n():
    """Per-token ``token_mean``: the loss tuples went to Megatron unchanged (plain sums), and
    Megatron divides by the step's token count."""
    masks = make_masks()
    sums = [torch.tensor(x) for x in (2.0, 0.5, 0.0, 4.0)]
    state = state_for("token_mean", masks, contributions=sums, per_token=True)
    assert state.passthrough  # Megatron's own division by N is the mode
    n, s = ref_counts(masks)
    assert_metrics(
        reduce_step_metrics(state), {"loss": 6.5 / n, "num_tokens": n, "num_sequences": s}
    )


def test_off_reduces_only_the_reports_megatron_returned():
    """``off`` saw nothing but the loss stage's reports: their entries are reduced, and the
    plugin's own numbers (loss, N, S) are absent."""
    reports = make_reports(4)
    off = LossFixConfig(reduction="off")
    state = StepRecord(off, num_microbatches=4, pg_collection=None, groups=NO_GROUPS)
    state.reports = reports
    assert_metrics(reduce_step_metrics(state), ref_reduced_stats(reports))
    empty = StepRecord(off, num_microbatches=4, pg_collection=None, groups=NO_GROUPS)
    assert empty.passthrough and reduce_step_metrics(empty) == {}


def test_metrics_before_any_step_are_refused():
    with pytest.raises(ValueError, match="no step has run yet"):
        reduce_step_metrics(None)
