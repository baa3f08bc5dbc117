"""``loss_weights`` on several ranks (pool ranks): without a group after Megatron's parallel state
is initialized it refuses, in one line, rather than return this rank's weights as the step's;
``rank_local=True`` asks for those; ``dp_group`` gives the step's."""

from __future__ import annotations

import pytest
import torch

from megatron_lossfix import loss_weights

pytestmark = pytest.mark.oracle

# Rank 0 holds 2 loss tokens, rank 1 holds 4: N = 6 over the data-parallel group.
MASKS = (torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]))


def _weights_on_rank() -> dict:
    """This rank's token_mean weights three ways, after ``initialize_model_parallel`` (DP2)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_lossfix.audit.training import Layout, init_layout

    init_layout(Layout())
    masks = [MASKS[dist.get_rank()]]
    try:
        loss_weights(masks, "token_mean")
        refused = None
    except ValueError as exc:
        refused = str(exc)
    local = loss_weights(masks, "token_mean", rank_local=True)[0]
    dp = loss_weights(masks, "token_mean", dp_group=ps.get_data_parallel_group())[0]
    return {"refused": refused, "local": float(local.sum()), "dp": float(dp.sum())}


def test_loss_weights_without_a_group_on_two_ranks(dist_pool):
    results = dist_pool.run(_weights_on_rank, 2)
    for rank, res in enumerate(results):
        assert res["refused"] is not None, f"rank {rank}: rank-local weights, silently: {res}"
        assert "\n" not in res["refused"] and "on 2 ranks" in res["refused"]
        assert "dp_group=" in res["refused"] and "rank_local=True" in res["refused"]
        assert res["local"] == pytest.approx(1.0)  # asked for: this rank's tokens alone
    # With the group: the step's weights, 1/6 per token; 2/6 and 4/6 of the loss.
    assert [res["dp"] for res in results] == pytest.approx([2 / 6, 4 / 6])
