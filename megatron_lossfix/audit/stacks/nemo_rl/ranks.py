"""``--stack nemo-rl``: what each rank runs, NeMo-RL's own Megatron training step.

The step is ``MegatronPolicyWorkerImpl.train`` (or the split path ``begin_train_step``,
``train_microbatch`` per chunk, ``finish_train_step``), unchanged, on an instance made without
its ``__init__`` (which builds a model from a Hugging Face checkpoint through Megatron Bridge):
the attributes its step reads are set here, the model is the audit's tiny GPT (Megatron DDP,
``calculate_per_token_loss=True`` and ``average_in_collective=False``, as NeMo-RL's setup
configures them), the optimizer and LR scheduler are stand-ins that keep the gradient (no
parameter update) and say so in their names. Each DP rank holds its contiguous slice of the
step's rows, as NeMo-RL's controller shards a batch.

The adapted rows run the same code after :func:`megatron_lossfix.integrations.nemo_rl.enable`.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import torch

from megatron_lossfix.audit.stacks.nemo_rl import batch as nb

__all__ = [
    "ADAPTED_ROW",
    "NEMO_RL_ROW",
    "ROWS",
    "nemo_rl_layout_grads",
    "tiny_gpt_kwargs",
]

NEMO_RL_ROW, ADAPTED_ROW = "nemo-rl", "nemo-rl+lossfix"
ROWS: tuple[str, ...] = (NEMO_RL_ROW, ADAPTED_ROW)


def tiny_gpt_kwargs() -> dict[str, Any]:
    """The tiny GPT every layout and the reference build: no attention and no position
    embedding (a token's output depends on its own id alone, so packing, padding and
    context-parallel sharding cannot change it without Transformer Engine)."""
    return dict(no_attention=True, position_embedding_type="none", seq_len=nb.WIDTH)


class KeepGradientOptimizer:
    """The optimizer the step calls: ``step()`` leaves parameters and gradients as they are
    (the audit reads the gradient the step produced) and reports success."""

    def __init__(self) -> None:
        self.param_groups = [{"lr": 0.0}]
        self.grad_norms_by_group: dict[str, Any] = {}

    def zero_grad(self) -> None:
        return None

    def step(self) -> tuple[bool, float, int]:
        return True, 0.0, 0


class ConstantScheduler:
    """The LR scheduler the step reads: learning rate 0, weight decay 0."""

    def get_lr(self, group: Any) -> float:
        return 0.0

    def get_wd(self) -> float:
        return 0.0

    def step(self, increment: int) -> None:
        return None


def make_worker(model: Any, cfg: dict[str, Any]) -> Any:
    """A ``MegatronPolicyWorkerImpl`` with the attributes its training step reads."""
    from megatron.core import parallel_state as ps
    from nemo_rl.models.policy.workers.megatron_policy_worker import MegatronPolicyWorkerImpl
    from nemo_rl.utils.timer import Timer

    worker = MegatronPolicyWorkerImpl.__new__(MegatronPolicyWorkerImpl)
    worker.model = model
    worker.optimizer = KeepGradientOptimizer()
    worker.scheduler = ConstantScheduler()
    worker.cfg = cfg
    worker.dp_size = ps.get_data_parallel_world_size()
    worker.rank = torch.distributed.get_rank()
    worker.timer = Timer()
    worker.mcore_state = types.SimpleNamespace(straggler_timer=None, cfg=None)
    worker.megatron_cfg = types.SimpleNamespace(
        optimizer=types.SimpleNamespace(reuse_grad_buf_for_mxfp8_param_ag=False),
        ddp=types.SimpleNamespace(overlap_param_gather=False),
    )
    worker.sampling_params = None
    worker.draft_model = None
    worker.delegate_pack_to_model = False
    worker.delegate_mtp_loss_mask_to_model = False
    worker.model_slices_context_parallel_inputs = False
    worker.media_placeholder_token_id = None
    worker.should_disable_forward_pre_hook = False
    worker._first_train_step_forward_pre_hook_disabled = False
    worker._router_replay_enabled = False
    worker.defer_fp32_logits = False
    worker.dtype = torch.float32
    worker.fp8_cfg = None
    return worker


def _local_rows(setting: str, vocab: int, mbs: int, packed: bool) -> Any:
    """This DP rank's contiguous slice of the step's rows, as a ``BatchedDataDict``; packed:
    with the micro-batch boundaries NeMo-RL's controller sets for sequence packing (``mbs``
    rows each, one global batch)."""
    from megatron.core import parallel_state as ps
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    full = nb.step_batch(setting, vocab)
    rows = full["input_ids"].shape[0]
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per = rows // dp
    local = BatchedDataDict({k: v[rank * per : (rank + 1) * per].clone() for k, v in full.items()})
    if packed:
        bounds = [(start, start + mbs) for start in range(0, per, mbs)]
        local.micro_batch_indices = [bounds]
        local.micro_batch_lengths = [[nb.WIDTH * mbs for _ in bounds]]
    return local


def run_step(worker: Any, setting: str, data: Any, mbs: int, chunks: int) -> None:
    """One NeMo-RL training step: ``train()`` (``chunks == 0``) or the split path with
    ``chunks`` ``train_microbatch`` calls over this rank's rows."""
    loss = nb.loss_fn(setting)
    gbs = data.size * worker.dp_size
    if chunks == 0:
        worker.train(data, loss, gbs=gbs, mbs=mbs)
        return
    worker.begin_train_step(loss, gbs=gbs, mbs=mbs)
    per = data.size // chunks
    for c in range(chunks):
        worker.train_microbatch(data.slice(c * per, (c + 1) * per))
    worker.finish_train_step()


def nemo_rl_layout_grads(
    layout: Any,
    runs: Sequence[tuple[str, str]],
    mbs: int,
    chunks: int = 0,
    packed: bool = False,
) -> dict[tuple[str, str], dict[str, torch.Tensor]] | None:
    """Each ``(row, setting)`` of ``runs`` as one NeMo-RL step under ``layout`` (``mbs`` rows per
    micro-batch; ``chunks`` > 0: the split path; ``packed``: sequence packing, each micro-batch
    one THD row); the full gradients on global rank 0."""
    from megatron_lossfix.audit import tiny_gpt
    from megatron_lossfix.audit.stacks.nemo_rl.cpu import prepare_nemo_rl_imports
    from megatron_lossfix.integrations.nemo_rl import adapter

    prepare_nemo_rl_imports()
    tiny_gpt.init_layout(layout)
    (model, *rest), config = tiny_gpt.build_tiny_gpt(
        layout, calculate_per_token_loss=True, **tiny_gpt_kwargs()
    )
    if rest:
        raise ValueError("the nemo-rl stack runs without virtual pipeline stages")
    out = {}
    for row, setting in runs:
        sizes = (layout.tp, layout.pp, layout.cp)
        cfg = nb.policy_cfg(mbs, 0, packed, sizes)
        worker = make_worker(model, cfg)
        tiny_gpt.set_deterministic_params([model], seed=0)
        model.zero_grad_buffer()
        data = _local_rows(setting, config.vocab_size, mbs, packed)
        with adapter.enabled(row == ADAPTED_ROW):
            run_step(worker, setting, data, mbs, chunks)
        out[(row, setting)] = tiny_gpt.gather_full_grads([model])
    return out if torch.distributed.get_rank() == 0 else None
