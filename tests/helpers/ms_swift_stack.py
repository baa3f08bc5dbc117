"""Rank functions for tests/test_ms_swift_stack.py (module-level, so the rank pool can pickle
them): the stack's worker with the adapter bypassed or weakened, each of which the adapted row's
check must catch."""

from __future__ import annotations

from typing import Any


def bypassed_layout_grads(layout: Any, case: Any, num_microbatches: int, rows: Any,
                          settings: Any) -> Any:  # fmt: skip
    """The adapted row with the adapter bypassed: the switch leaves ms-swift's own
    ``train_step`` (what a user gets whose step never reaches the plugin)."""
    from megatron_lossfix.audit.stacks.ms_swift import ranks
    from megatron_lossfix.integrations.ms_swift import adapter

    own = adapter.enable
    adapter.enable = lambda **kw: adapter.disable
    try:
        return ranks.swift_layout_grads(layout, case, num_microbatches, (ranks.ADAPTED_ROW,),
                                        settings)  # fmt: skip
    finally:
        adapter.enable = own


def micro_batch_mean_grads(layout: Any, case: Any, num_microbatches: int, rows: Any,
                           settings: Any) -> Any:  # fmt: skip
    """The adapted row with each unit's weight replaced by ms-swift's per-micro-batch mean,
    ``1 / (units of the micro-batch x micro-batches x DP)``, instead of the plugin's pair
    weight (layouts without context parallelism)."""
    from megatron.core import parallel_state as ps

    from megatron_lossfix.audit.stacks.ms_swift import ranks
    from megatron_lossfix.integrations.ms_swift import adapter

    own = adapter._pair_weights

    def mean_of_the_micro_batch(weights: Any, pair_ids: Any, cu: Any) -> Any:
        import torch

        units = int(pair_ids.max()) + 1  # the layout is set up by now
        dp = ps.get_data_parallel_world_size()
        w = torch.zeros(len(pair_ids), dtype=torch.float32, device=weights.device)
        w[:units] = 1.0 / (units * num_microbatches * dp)
        return w

    adapter._pair_weights = mean_of_the_micro_batch
    try:
        return ranks.swift_layout_grads(layout, case, num_microbatches, (ranks.ADAPTED_ROW,),
                                        settings)  # fmt: skip
    finally:
        adapter._pair_weights = own


def micro_batch_kl_grads(layout: Any, case: Any, num_microbatches: int, rows: Any,
                         settings: Any) -> Any:  # fmt: skip
    """The adapted row with KTO's KL baseline taken per micro-batch (``enable(kto_kl=
    "micro_batch")``, ms-swift's own meaning) instead of over the step."""
    from megatron_lossfix.audit.stacks.ms_swift import ranks
    from megatron_lossfix.integrations.ms_swift import adapter

    own = adapter.enable
    adapter.enable = lambda **kw: own(kto_kl="micro_batch")
    try:
        return ranks.swift_layout_grads(layout, case, num_microbatches, (ranks.ADAPTED_ROW,),
                                        settings)  # fmt: skip
    finally:
        adapter.enable = own


def refusal() -> str:
    """What the adapter says to a trainer it does not cover (ms-swift's GRPO trainer)."""
    from megatron_lossfix.integrations.ms_swift.cpu import provide_transformer_engine

    provide_transformer_engine()
    from swift.megatron.trainers.grpo_trainer import MegatronGRPOTrainer

    from megatron_lossfix.integrations.ms_swift import adapter

    try:
        adapter._kind(MegatronGRPOTrainer.__new__(MegatronGRPOTrainer))
    except ValueError as exc:
        return str(exc)
    return ""
