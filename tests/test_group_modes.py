"""The group-keyed modes (docs/design.md §2): ``group_mean`` (SkyRL's ``prompt_mean``) and the
sequence modes over trajectories, through ``loss_weights``, against plain-PyTorch references.

The reference of SkyRL's definition is written out by hand from its documented rule (SkyRL
0.4.0, ``apply_loss_reduction_to_advantages_minibatch``): token t of a response of prompt p
weighs ``1 / (num_prompts * tokens_in_prompt_p)``, with ``num_prompts`` every prompt of the
mini-batch, all-masked ones included. The plugin counts only groups that have a loss token, as
it counts only sequences that have one; the two agree whenever every group has a loss token.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from helpers.prompt_groups import PROMPT_ROWS, SEQ, global_batch, skyrl_prompt_mean

from megatron_lossfix import REDUCTIONS, loss_weights
from megatron_lossfix.runtime.weights import ALIASES, MODES

DP, MICRO_BATCHES, ROWS_PER_MB = 2, 3, 2


def _rank_microbatches(tensor, rank: int) -> list:
    first = rank * MICRO_BATCHES * ROWS_PER_MB
    return [
        tensor[first + k * ROWS_PER_MB : first + (k + 1) * ROWS_PER_MB]
        for k in range(MICRO_BATCHES)
    ]


def _plugin_loss_one_rank(mask, loss, ids, mode="group_mean", **kwargs) -> float:
    """All 6 micro-batches on one rank (no process group)."""
    ids_t = torch.tensor(ids)
    masks = list(torch.split(mask, ROWS_PER_MB))
    weights = loss_weights(
        masks,
        mode,
        group_ids=list(torch.split(ids_t, ROWS_PER_MB)),
        num_groups=len(PROMPT_ROWS),
        **kwargs,
    )
    return sum(
        float((w.double() * x).sum()) for w, x in zip(weights, torch.split(loss, 2), strict=True)
    )


# ---------------------------------------------------------------------------------- unit


@pytest.mark.unit
def test_group_mean_is_a_mode_and_prompt_mean_its_alias():
    assert "group_mean" in REDUCTIONS and "group_mean" in MODES
    assert ALIASES == {"prompt_mean": "group_mean"}
    mask, _, ids = global_batch()
    kwargs = dict(group_ids=[torch.tensor(ids)], num_groups=4)
    for got, want in zip(
        loss_weights([mask], "prompt_mean", **kwargs),
        loss_weights([mask], "group_mean", **kwargs),
        strict=True,
    ):
        assert torch.equal(got, want)


@pytest.mark.unit
def test_hand_computed_group_weights():
    # Group 0: rows 0 (2 tokens) and 3 (3 tokens) -> n = 5; group 1: row 1 (1 token), row 2
    # (0 tokens) -> n = 1; group 2: only an empty row; group 3: absent. G = 2.
    mb0 = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    mb1 = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    ids = [torch.tensor([0, 1]), torch.tensor([1, 0, 2])]
    w0, w1 = loss_weights([mb0, mb1], "group_mean", group_ids=ids, num_groups=4)
    torch.testing.assert_close(w0, torch.tensor([[0.1, 0.1, 0.0], [0.5, 0.0, 0.0]]))
    torch.testing.assert_close(w1, torch.tensor([[0.0] * 3, [0.1] * 3, [0.0] * 3]))


@pytest.mark.unit
def test_one_rank_matches_skyrl_when_every_prompt_has_a_loss_token():
    mask, loss, ids = global_batch()
    got = _plugin_loss_one_rank(mask, loss, ids)
    assert got == pytest.approx(skyrl_prompt_mean(loss, mask, PROMPT_ROWS), rel=1e-6)


@pytest.mark.unit
def test_an_all_masked_prompt_is_where_skyrl_and_the_plugin_differ():
    """SkyRL counts the masked prompt among ``num_prompts``; the plugin does not (an empty group
    neither contributes nor counts, as an empty sequence): its loss is SkyRL's over the prompts
    that have a loss token, and SkyRL's own is (G - 1) / G of it."""
    mask, loss, ids = global_batch(masked_prompt=2)
    got = _plugin_loss_one_rank(mask, loss, ids)
    kept = [b for p, b in enumerate(PROMPT_ROWS) if p != 2]
    skyrl = skyrl_prompt_mean(loss, mask, PROMPT_ROWS)
    assert got == pytest.approx(skyrl_prompt_mean(loss, mask, kept), rel=1e-6)
    assert skyrl == pytest.approx(got * 3 / 4, rel=1e-6)
    assert abs(got - skyrl) > 0.1 * abs(got)


@pytest.mark.unit
def test_a_trajectory_split_into_rows_counts_once():
    """sequence_mean with trajectory ids: the rows of a trajectory (multi-turn, one row per
    step) form one sequence; without the ids each row counts as a sequence."""
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    loss = torch.tensor([[1.0, 1.0, 1.0], [4.0, 9.0, 9.0], [2.0, 2.0, 9.0]])
    # Trajectory 0 = rows 0 and 1 (4 tokens, token sum 7), trajectory 1 = row 2 (2 tokens).
    traj = dict(trajectory_ids=[torch.tensor([0, 0]), torch.tensor([1])], num_trajectories=2)
    masks, losses = [mask[:2], mask[2:]], [loss[:2], loss[2:]]

    def total(weights):
        return sum(float((w * x).sum()) for w, x in zip(weights, losses, strict=True))

    assert total(loss_weights(masks, "sequence_mean", **traj)) == pytest.approx((7 / 4 + 2) / 2)
    assert total(loss_weights(masks, "sequence_mean")) == pytest.approx((1 + 4 + 2) / 3)
    got = total(loss_weights(masks, "seq_mean_token_sum_norm", norm_constant=8.0, **traj))
    assert got == pytest.approx((7 + 4) / (2 * 8))


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({}, "needs each sequence's group id"),
        ({"group_ids": [torch.tensor([0, 1])]}, "num_groups must be an integer >= 1"),
        ({"group_ids": [torch.tensor([0, 1])], "num_groups": 0}, ">= 1"),
        ({"group_ids": [torch.tensor([0, 1])], "num_groups": True}, ">= 1"),
        ({"group_ids": [torch.tensor([0, 1])], "num_groups": 2.0}, ">= 1"),
        ({"group_ids": [torch.tensor([0, -1])], "num_groups": 2}, r"must lie in \[0, 2\)"),
        ({"group_ids": [torch.tensor([0, 2])], "num_groups": 2}, r"must lie in \[0, 2\)"),
        ({"group_ids": [torch.tensor([0.0, 1.0])], "num_groups": 2}, "must hold integers"),
        ({"group_ids": [torch.tensor([True, False])], "num_groups": 2}, "must hold integers"),
        ({"group_ids": [torch.tensor([0, 1, 1])], "num_groups": 2}, r"shape \(2,\)"),
        ({"group_ids": [torch.tensor([[0, 1]])], "num_groups": 2}, r"shape \(2,\)"),
        ({"group_ids": torch.tensor([0, 1]), "num_groups": 2}, "one integer tensor per"),
        ({"group_ids": [[0, 1]], "num_groups": 2}, "not a Tensor"),
        ({"group_ids": [], "num_groups": 2}, "0 entries for 1 micro-batches"),
    ],
)
def test_bad_group_ids_are_refused_in_one_line(kwargs, match):
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match=match) as err:
        loss_weights([mask], "group_mean", **kwargs)
    assert "\n" not in str(err.value)


@pytest.mark.unit
@pytest.mark.parametrize(
    "mode, kwargs",
    [
        ("token_mean", {"group_ids": [torch.tensor([0, 1])], "num_groups": 2}),
        ("sequence_mean", {"group_ids": [torch.tensor([0, 1])], "num_groups": 2}),
        ("group_mean", {"trajectory_ids": [torch.tensor([0, 1])], "num_trajectories": 2}),
        ("sum", {"trajectory_ids": [torch.tensor([0, 1])], "num_trajectories": 2}),
    ],
)
def test_ids_a_mode_would_ignore_are_refused(mode, kwargs):
    kwargs = {**kwargs}
    if mode == "group_mean":
        kwargs.update(group_ids=[torch.tensor([0, 1])], num_groups=2)
    with pytest.raises(ValueError, match="apply only to"):
        loss_weights([torch.ones(2, 3)], mode, **kwargs)


# ---------------------------------------------------------------------------------- ranks


def _two_rank_loss(mode: str, masked_prompt: int | None, ids_fault: str | None) -> float:
    """This rank's ``sum(w * l)`` over its 3 micro-batches, weights from ``loss_weights`` over
    a named group of both ranks (the data-parallel group)."""
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    mask, loss, ids = global_batch(masked_prompt)
    ids_t = torch.tensor(ids)
    num_groups = len(PROMPT_ROWS)
    if ids_fault == "out_of_range" and rank == 1:
        ids_t = ids_t.clone()
        ids_t[-1] = num_groups
    if ids_fault == "range" and rank == 1:
        num_groups += 1
    weights = loss_weights(
        _rank_microbatches(mask, rank),
        mode,
        dp_group=group,
        group_ids=_rank_microbatches(ids_t, rank),
        num_groups=num_groups,
    )
    return sum(
        float((w.double() * x).sum())
        for w, x in zip(weights, _rank_microbatches(loss, rank), strict=True)
    )


def _refusal(mode: str, ids_fault: str) -> str:
    try:
        _two_rank_loss(mode, None, ids_fault)
    except ValueError as exc:
        return str(exc)
    return "not refused"


@pytest.mark.oracle
def test_a_prompt_over_two_ranks_and_three_microbatches_matches_skyrl(dist_pool):
    mask, loss, _ = global_batch()
    for mode in ("group_mean", "prompt_mean"):
        per_rank = dist_pool.run(_two_rank_loss, DP, mode, None, None)
        want = skyrl_prompt_mean(loss, mask, PROMPT_ROWS)
        assert sum(per_rank) == pytest.approx(want, rel=1e-6), (mode, per_rank, want)
    # Counting on each rank alone (no DP group) gives another loss: the check can fail.
    one_rank_each = sum(
        _plugin_loss_one_rank(
            torch.cat(_rank_microbatches(mask, r)),
            torch.cat(_rank_microbatches(loss, r)),
            torch.cat(_rank_microbatches(torch.tensor(global_batch()[2]), r)).tolist(),
        )
        for r in range(DP)
    )
    assert abs(one_rank_each - want) > 0.05 * want


@pytest.mark.oracle
def test_an_all_masked_prompt_over_two_ranks(dist_pool):
    mask, loss, _ = global_batch(masked_prompt=1)  # the prompt that straddles the ranks
    got = sum(dist_pool.run(_two_rank_loss, DP, "group_mean", 1, None))
    kept = [b for p, b in enumerate(PROMPT_ROWS) if p != 1]
    assert got == pytest.approx(skyrl_prompt_mean(loss, mask, kept), rel=1e-6)
    assert skyrl_prompt_mean(loss, mask, PROMPT_ROWS) == pytest.approx(got * 3 / 4, rel=1e-6)


@pytest.mark.oracle
@pytest.mark.parametrize(
    "fault, on_rank_1, on_rank_0",
    [
        ("out_of_range", r"group_ids of micro-batch 2 must lie in \[0, 4\)", "another rank"),
        ("range", "disagree on the id range", "disagree on the id range"),
    ],
)
def test_bad_group_ids_on_one_rank_are_refused_on_both(dist_pool, fault, on_rank_1, on_rank_0):
    import re

    messages = dist_pool.run(_refusal, DP, "group_mean", fault)
    assert re.search(on_rank_0, messages[0]) and re.search(on_rank_1, messages[1]), messages
    assert all("\n" not in m for m in messages)


@pytest.mark.unit
def test_rl_objective_weights_kl_and_entropy_by_group():
    """rl_objective with group_mean weights, micro-batch by micro-batch: the policy loss, the KL
    and the entropy terms are each the mean over prompts of their token mean in the prompt
    (reference: explicit loops over prompts and tokens)."""
    from megatron_lossfix.rl.objective import RLObjective, rl_objective

    mask, _, ids = global_batch()
    gen = torch.Generator().manual_seed(5)
    logp = -torch.rand(mask.shape, generator=gen, dtype=torch.float64) * 2
    old = logp + 0.2 * torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    ref = logp + 0.3 * torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    entropy = torch.rand(mask.shape, generator=gen, dtype=torch.float64)
    adv = torch.randn(mask.shape[0], generator=gen, dtype=torch.float64)
    obj = RLObjective(kl_coef=0.1, entropy_coef=0.05)
    ids_t = torch.tensor(ids)

    def objective(mode: str, **kwargs) -> float:
        parts = [torch.split(t, ROWS_PER_MB) for t in (logp, old, adv, mask, ref, entropy, ids_t)]
        masks = list(parts[3])
        weights = loss_weights(masks, mode, **kwargs)
        total = 0.0
        for k, w in enumerate(weights):
            lp, o, a, m, r, h, _ = (p[k] for p in parts)
            value, _ = rl_objective(lp, o, a, w.double(), m.bool(), obj, ref_logprobs=r, entropy=h)
            total += float(value)
        return total

    got = objective("group_mean", group_ids=list(torch.split(ids_t, 2)), num_groups=4)
    want, prompts = 0.0, 0
    for start, end in PROMPT_ROWS:
        terms, tokens = 0.0, 0
        for i in range(start, end):
            for t in range(SEQ):
                if mask[i, t]:
                    ratio = float(torch.exp(logp[i, t] - old[i, t]))
                    a = float(adv[i])
                    pg = -min(ratio * a, min(max(ratio, 0.8), 1.2) * a)
                    d = float(ref[i, t] - logp[i, t])
                    kl = float(torch.exp(torch.tensor(d))) - d - 1
                    terms += pg + 0.1 * kl - 0.05 * float(entropy[i, t])
                    tokens += 1
        if tokens:
            want += terms / tokens
            prompts += 1
    want /= prompts
    assert got == pytest.approx(want, rel=1e-6)
    # The token mean weighs long prompts more: another value (the check can fail).
    assert abs(objective("token_mean") - want) > 1e-3 * abs(want)


# ---------------------------------------------------------------------------------- the step
# One step of the tiny GPT through LossFixSchedule (the audit's oracle), against the one-rank,
# one-micro-batch reference. The matrix of every mode on every layout, group_mean included, is
# tests/test_invariance.py and tests/test_hard_layouts.py; here: trajectories, and that the
# per-group counts must be global.

NO_ATTENTION = {"no_attention": True}
TRAJECTORY_CASES = {
    "dp2-m3": ({"trajectory_rows": 3}, "dp2-m3"),
    "tp2-pp2-dp2-m3": ({"trajectory_rows": 3}, "tp2-pp2-dp2-m3"),
    "cp2xdp2-m3-sharded-data": (
        {
            "trajectory_rows": 3,
            "model_kwargs": NO_ATTENTION,
            "schedule_kwargs": {"data_is_cp_sharded": True},
        },
        "cp2-dp2-m3",
    ),
    "packed-dp2-m3": (
        {"trajectory_rows": 3, "model_kwargs": NO_ATTENTION, "packed": True},
        "dp2-m3",
    ),
}


@pytest.mark.oracle
@pytest.mark.parametrize("name", list(TRAJECTORY_CASES))
def test_trajectories_split_into_rows_count_once_under_every_layout(dist_pool, name):
    """The batch's rows come in trajectories of 3 (straddling micro-batches and ranks): the
    sequence modes weigh trajectories, exactly; a reference that weighs rows is another
    gradient (so the check can fail)."""
    from megatron_lossfix.audit.matrix import check_layout, parse_layout
    from megatron_lossfix.audit.oracle import OracleCase, reference_grads, relative_error

    kwargs, layout_name = TRAJECTORY_CASES[name]
    lay = parse_layout(layout_name)
    case = OracleCase(**kwargs)
    modes = ("sequence_mean", "seq_mean_token_sum_norm")
    checks = check_layout(
        dist_pool, case, lay.parallel(), lay.world_size, lay.num_microbatches, modes
    )
    errors = {m: checks[m]["error"] for m in modes}
    assert max(errors.values()) <= 1e-5, errors
    rows = OracleCase(**{k: v for k, v in kwargs.items() if k != "trajectory_rows"})
    for mode in modes:
        per_row = dist_pool.run(reference_grads, 1, rows, mode)[0]["grads"]
        assert relative_error(checks[mode]["result"]["grads"], per_row) > 1e-3, mode


def _local_group_counts(*args, **kwargs):
    """The oracle's layout step with each rank's per-group counts left local (the all-reduce
    over DP x CP skipped): what the step would do without its group all-reduce."""
    import megatron_lossfix.step.agree as step_agree
    from megatron_lossfix.audit.oracle import layout_grads

    real = step_agree._group_tokens

    def local(counts, ids, groups):
        return real(counts, ids, dataclasses.replace(groups, dp_cp=None))

    step_agree._group_tokens = local
    try:
        return layout_grads(*args, **kwargs)
    finally:
        step_agree._group_tokens = real


@pytest.mark.oracle
def test_group_counts_left_local_miss_the_reference(dist_pool):
    from megatron_lossfix.audit.matrix import check_layout, parse_layout
    from megatron_lossfix.audit.oracle import OracleCase

    lay, case = parse_layout("dp2-m3"), OracleCase()
    args = (dist_pool, case, lay.parallel(), lay.world_size, lay.num_microbatches, ("group_mean",))
    assert check_layout(*args)["group_mean"]["error"] <= 1e-5
    missed = check_layout(*args, worker=_local_group_counts)["group_mean"]["error"]
    assert missed > 1e-3, missed
