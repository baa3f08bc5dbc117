"""A step the plugin refuses on the loss stage of PP2 x DP2 is refused on every rank, in seconds.

One rank (global rank 3: last pipeline stage, DP rank 1) gets input the plugin cannot work
with; every rank must end its step with a StepRefused naming the problem -- the broken rank with
the details, its DP peer and both first-stage ranks naming that rank -- long before the hold
(``refusal_case`` keeps a failed rank connected for ``HOLD_S``, as a live process would, so a
peer left waiting in Megatron's point-to-point would take ``HOLD_S`` and end with a connection
error). Before the pre-step agreement covered the pipeline, the first-stage ranks waited there;
before the agreement after the step, a loss function's error (``int-loss``) left every other rank
waiting in Megatron's point-to-point or DDP's all-reduce.
"""

from __future__ import annotations

import pytest
from helpers.refusal import refusal_case

pytestmark = pytest.mark.oracle

HOLD_S = 60.0
LIMIT_S = 20.0  # generous for a loaded 2-core machine; a refusal takes well under a second

# case -> (what the broken rank says, what the other ranks name)
CASES = {
    "missing-mask": (
        "must be a dict holding the loss mask under 'loss_mask'",
        "a micro-batch is not a dict holding the loss mask",
    ),
    "non-dict": ("got int", "a micro-batch is not a dict holding the loss mask"),
    "no-iterator": ("needs a data iterator", "the loss stage has no data iterator"),
    "range": (
        "'range' object is not an iterator; pass an iterator (iter(...))",
        "the loss stage's data iterator could not be read",
    ),
    "oserror": (
        "reading micro-batch 1 from the data iterator raised OSError: simulated read error",
        "the loss stage's data iterator could not be read",
    ),
    "fractional-mask": (
        "must hold only 0 and 1",
        "a loss mask holds values other than 0 and 1",
    ),
    "short": ("ran out after 1 micro-batches", "ran out before num_microbatches"),
    "per-token-missing-mask": (
        "must be a dict holding the loss mask",
        "a micro-batch is not a dict holding the loss mask",
    ),
    # Found inside Megatron's schedule: the loss stage ends the schedule with a zero loss, and
    # the agreement after the step tells every rank.
    "int-loss": (
        "ValueError: loss_func must return a one-element loss tensor first, got int "
        "(micro-batch 0)",
        "the loss function failed or returned what the plugin cannot use",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refusal_on_the_loss_stage_reaches_every_rank(dist_pool, case):
    results = dist_pool.run(refusal_case, 4, case, "token_mean", 3, HOLD_S)
    own, others = CASES[case]
    for rank, (kind, message, seconds) in enumerate(results):
        assert seconds < LIMIT_S, f"rank {rank} took {seconds:.1f} s: {results}"
        assert message is not None and message.startswith("megatron_lossfix refused this step: "), (
            rank,
            results,
        )
        if rank == 3:
            assert kind == "StepRefused" and own in message, results
        else:
            assert kind == "ProblemOnAnotherRank", (rank, results)
            assert others in message and "reported by global rank 3" in message, (rank, results)


def test_the_same_input_is_fine_for_off_when_the_loss_function_copes(dist_pool):
    """``off`` is stock: a batch without a mask is not its business (the loss function here
    reads ``loss_weights`` only through ``batch.get``, and stock Megatron never looks)."""
    results = dist_pool.run(refusal_case, 4, "fractional-mask", "off", 3, HOLD_S)
    assert [kind for kind, _, _ in results] == ["ok"] * 4, results


# case -> what the broken rank says (its peers name the kind, as above); group_mean's ids.
GROUP_CASES = {
    "group-id-range": r"'group_ids' of micro-batch 0 must lie in [0, 2)",
    "group-id-float": "'group_ids' of micro-batch 0 must hold integers",
    "group-ids-missing": "needs each sequence's group id",
}
GROUP_KIND = "a micro-batch's group or trajectory ids are missing, malformed or out of range"


@pytest.mark.parametrize("case", [*GROUP_CASES, "group-range-disagree"])
def test_bad_group_ids_are_refused_on_every_rank_and_nothing_is_trained(dist_pool, case):
    from helpers.refusal import refusal_and_gradient

    results = dist_pool.run(refusal_and_gradient, 4, case, "group_mean", 3, HOLD_S)
    for rank, (kind, message, seconds, largest_grad) in enumerate(results):
        assert seconds < LIMIT_S, f"rank {rank} took {seconds:.1f} s: {results}"
        assert message is not None and "\n" not in message, (rank, results)
        assert largest_grad == 0.0, f"rank {rank} holds a gradient: {results}"
        if case == "group-range-disagree":  # every rank reads the same sums
            assert kind == "StepRefused", (rank, results)
            assert "disagree on the group ids' range" in message, (rank, results)
        elif rank == 3:
            assert kind == "StepRefused" and GROUP_CASES[case] in message, results
        else:
            assert kind == "ProblemOnAnotherRank", (rank, results)
            assert GROUP_KIND in message and "reported by global rank 3" in message, results
    # The same data with good ids trains (the check above can fail).
    ok = dist_pool.run(refusal_and_gradient, 4, "none", "group_mean", 3, HOLD_S)
    assert all(kind == "ok" and largest > 0 for kind, _, _, largest in ok), ok
