"""ms-swift's Megatron trainers through the plugin (``megatron_lossfix.integrations.ms_swift``).

The switch :func:`enable` wraps ``BaseMegatronTrainer.train_step`` (ms-swift 4.6.0,
``swift/megatron/trainers/base.py``) in this process: while a DPO, KTO or reward-model
trainer's step runs, the ``get_forward_backward_func`` it looks up answers with the plugin's
schedule (:class:`~megatron_lossfix.step.schedule.LossFixSchedule`) in ``pair_mean``: every DPO
pair, every KTO example and every reward pair counts the same, whatever micro-batch holds it
and however many that micro-batch holds. ms-swift's own ``forward_step`` runs (its
``get_batch``, the policy and reference forwards); its loss is built from ms-swift's own
pieces (``get_logps``, Swift's ``dpo_loss``, TRL's ``kto_loss`` through its
``DummyKTOTrainer``, the reward model's ``get_last_tokens`` and its
``-log sigmoid(r_c - r_r [- margin])``), each unit's loss weighted by the plugin's pair weight
(``runtime.pairs.pair_weights``) instead of ``loss.mean()`` over the micro-batch.
What changes, besides:

* DPO's ``loss_type`` is passed to ``dpo_loss`` (ms-swift 4.6.0 leaves it out, so that hinge and
  IPO train as sigmoid); IPO takes per-token mean log-probs, as Swift's own ``DPOTrainer`` does.
  Loss types that couple the pairs of a batch (``bco_pair``'s running mean, ``aot``'s sort) are
  refused in one line, and so is more than one.
* ``rpo_alpha``'s NLL term is the chosen responses' token mean over the whole step (ms-swift
  takes it per micro-batch: on one rank with one micro-batch, the same), with the plugin's
  ``token_mean`` weights of the chosen tokens.
* KTO's KL baseline (``calculate_KL``): by default the mean over the step's KL completions
  (``kto_kl="step"``, what ms-swift computes on one rank with one micro-batch), from a
  forward-only pass over the step's micro-batches before it; ``kto_kl="micro_batch"`` keeps
  ms-swift's own (the micro-batch's mean, averaged over data-parallel ranks).

SFT (``MegatronTrainer``: ``(sum(loss x mask), tokens)`` with ``calculate_per_token_loss``) is
already the step's token mean under every layout: its step runs as released. The reward
model's ``center_rewards_coefficient`` term (a mean of squared rewards per micro-batch as
released) is weighed per pair as well. Other trainers (GRPO, GKD, embedding, reranker) are
refused in one line. The first-step re-split check is off unless
``MEGATRON_LOSSFIX_MS_SWIFT_SELF_CHECK=1``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_lossfix.runtime.config import LossFixConfig
from megatron_lossfix.runtime.losses import loss_weights
from megatron_lossfix.runtime.pairs import pair_weights
from megatron_lossfix.step.schedule import LossFixSchedule
from megatron_lossfix.step.selfcheck import switched_on

__all__ = [
    "DPO_LOSS_TYPES",
    "KTO_KL",
    "SELF_CHECK_ENV",
    "SWIFT_MODE",
    "disable",
    "enable",
    "lossfix_config",
    "plugin_micro_batch",
]

#: The unit of ms-swift's preference losses (a DPO pair, a KTO example) as the plugin's mode.
SWIFT_MODE = "pair_mean"
#: The environment variable that turns the first-step re-split check on (``1``).
SELF_CHECK_ENV = "MEGATRON_LOSSFIX_MS_SWIFT_SELF_CHECK"
#: DPO loss types whose loss is one pair's alone (Swift's ``dpo_loss``): each can be weighted.
DPO_LOSS_TYPES: tuple[str, ...] = (
    "sigmoid", "robust", "exo_pair", "hinge", "ipo", "sppo_hard", "nca_pair", "apo_zero",
    "apo_down",
)  # fmt: skip
#: KTO loss types (TRL's ``kto_loss``): per example.
KTO_LOSS_TYPES: tuple[str, ...] = ("kto", "apo_zero_unpaired")
#: The meanings of KTO's KL baseline the adapter offers.
KTO_KL: tuple[str, ...] = ("step", "micro_batch")
#: Keys of the micro-batches the plugin reads, beside its own.
ITEM, RPO_WEIGHTS = "swift_item", "swift_rpo_weights"

_ORIGINAL: dict[str, Any] = {}


def lossfix_config() -> LossFixConfig:
    """The plugin configuration of ms-swift's preference steps: ``pair_mean`` over whole
    sequences (ms-swift slices them for context parallelism itself)."""
    checked = switched_on(
        SELF_CHECK_ENV, "ms-swift's adapter", "the adapter writes the loss from ms-swift's pieces"
    )
    return LossFixConfig(reduction=SWIFT_MODE, self_check=checked)


# ------------------------------------------------------------------------------ micro-batches


def _kind(trainer: Any) -> str:
    """``dpo``, ``kto``, ``rm`` or ``sft`` (the trainer classes the adapter knows); else a
    refusal."""
    from swift.megatron.trainers.dpo_trainer import MegatronDPOTrainer
    from swift.megatron.trainers.kto_trainer import MegatronKTOTrainer
    from swift.megatron.trainers.reward_trainer import MegatronRewardTrainer
    from swift.megatron.trainers.trainer import MegatronTrainer

    if isinstance(trainer, MegatronDPOTrainer):
        return "dpo"
    if isinstance(trainer, MegatronKTOTrainer):
        return "kto"
    if isinstance(trainer, MegatronRewardTrainer):
        return "rm"
    if type(trainer) is MegatronTrainer and trainer.args.task_type == "causal_lm":
        return "sft"
    raise ValueError(
        "the ms-swift adapter covers SFT, DPO, KTO and the reward model, not "
        f"{type(trainer).__name__}: call "
        "megatron_lossfix.integrations.ms_swift.disable() before training it"
    )


def _cu_seqlens(position_ids: torch.Tensor) -> torch.Tensor:
    """A packed row's sequence boundaries, where its position ids restart at 0 (as ms-swift's
    ``get_packed_seq_params`` finds them)."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).reshape(-1)
    end = torch.tensor([pos.numel()], device=pos.device)
    return torch.cat([starts, end]).to(torch.int32)


def plugin_micro_batch(item: dict[str, Any], kind: str, packed: bool) -> dict[str, Any]:
    """ms-swift's collated micro-batch ``item`` as the plugin reads it: the loss mask of its
    shifted labels, one pair id per sequence (a DPO micro-batch's chosen rows, then its rejected
    rows, in pair order; a KTO example alone), the packed boundaries, and the item itself. A
    reward model's sequences have no labels: their tokens (its attention mask) stand for them."""
    prefix = "completion_" if kind == "kto" else ""
    if kind == "rm":
        ids = item["input_ids"]
        real = item.get("attention_mask")
        mask = torch.ones_like(ids, dtype=torch.float32) if real is None else real.float()
    else:
        labels = torch.roll(item[prefix + "labels"], -1, dims=-1)  # ms-swift's shift
        mask = (labels != -100).float()
    out: dict[str, Any] = {"loss_mask": mask, ITEM: item}
    if packed:
        out["cu_seqlens"] = _cu_seqlens(item[prefix + "position_ids"])
        segments = len(out["cu_seqlens"]) - 1
        # The collator's sequences; a packed row's trailing padding is one more segment.
        n = len(item.get(prefix + "seq_lens", range(segments)))
    else:
        n = segments = mask.shape[0]
    # Every segment its own id; a DPO pair's chosen and rejected rows share theirs.
    ids = torch.arange(segments, device=mask.device)
    if kind in ("dpo", "rm"):
        k = n // 2
        ids[k:n] = torch.arange(k, device=mask.device)
        out["num_pairs"] = k
    if kind == "dpo":
        # The chosen responses' tokens (rpo_alpha's NLL term).
        chosen = mask.clone()
        if packed:
            chosen[:, int(out["cu_seqlens"][k]) :] = 0
        else:
            chosen[k:] = 0
        out["chosen_mask"] = chosen
    out["pair_ids"] = ids
    return out


def _cp_local(trainer: Any, tensor: torch.Tensor, packed_seq_params: Any) -> torch.Tensor:
    """This context-parallel rank's part of a whole-sequence tensor, sliced as ms-swift slices
    its labels (its own ``get_batch_on_this_cp_rank``)."""
    from swift.megatron.utils import get_batch_on_this_cp_rank

    batch = {"loss_scale": tensor, "packed_seq_params": packed_seq_params}
    return get_batch_on_this_cp_rank(trainer.args, batch)["loss_scale"]


def _local_cu_seqlens(trainer: Any, packed_seq_params: Any) -> torch.Tensor | None:
    if packed_seq_params is None:
        return None
    return packed_seq_params.cu_seqlens_q // trainer.args.context_parallel_size


# ------------------------------------------------------------------------------ the losses


def _one_loss_type(loss_type: Any, allowed: tuple[str, ...], what: str) -> str:
    types = list(loss_type) if isinstance(loss_type, (list, tuple)) else [loss_type]
    if len(types) != 1 or types[0] not in allowed:
        raise ValueError(
            f"the ms-swift adapter weighs each {what} alone: set loss_type to one of "
            f"{', '.join(allowed)} (got {loss_type!r}), or disable the adapter"
        )
    return types[0]


def _pair_weights(weights: torch.Tensor, pair_ids: torch.Tensor, cu: Any) -> torch.Tensor:
    return pair_weights(weights, pair_ids, cu_seqlens=cu)


def _dpo_loss(trainer: Any, mb: dict[str, Any], output_tensor: torch.Tensor, *,
              labels: torch.Tensor, packed_seq_params: Any) -> tuple:  # fmt: skip
    """ms-swift's DPO loss of one micro-batch as the plugin's weighted sum (module docstring)."""
    args = trainer.args
    half = output_tensor.shape[0] // 2
    ref_output, output = output_tensor[:half].detach(), output_tensor[half:]
    k = mb["num_pairs"]
    logps = trainer.get_logps(output, labels, packed_seq_params)
    ref_logps = trainer.get_logps(ref_output, labels, packed_seq_params)
    loss_type = _one_loss_type(args.loss_type, DPO_LOSS_TYPES, "DPO pair")
    if loss_type == "ipo":  # per-token mean log-probs, as Swift's own DPOTrainer takes them
        counts = trainer.get_logps(-torch.ones_like(output), labels, packed_seq_params)
        counts = counts.clamp(min=1)
        logps, ref_logps = logps / counts, ref_logps / counts
    losses, chosen_rewards, rejected_rewards = trainer.dummy_dpo_trainer.dpo_loss(
        logps[:k], logps[k:], ref_logps[:k], ref_logps[k:], loss_type=loss_type
    )
    weights = _cp_local(trainer, mb["loss_weights"], packed_seq_params)
    cu = _local_cu_seqlens(trainer, packed_seq_params)
    w = _pair_weights(weights, mb["pair_ids"], cu)[:k]
    loss = (w.to(losses.dtype) * losses).sum()
    if args.rpo_alpha:
        rpo = _cp_local(trainer, mb[RPO_WEIGHTS], packed_seq_params)
        loss = loss + args.rpo_alpha * (rpo * output.float()).sum()
    report = {
        "loss": loss.detach().clone(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
    }
    return loss, report


def _rm_loss(trainer: Any, mb: dict[str, Any], output_tensor: torch.Tensor, *,
             data: dict) -> tuple:  # fmt: skip
    """ms-swift's reward-model loss of one micro-batch as the plugin's weighted sum: each pair's
    ``-log sigmoid(r_c - r_r [- margin])`` and ``center_rewards_coefficient x (r_c + r_r)^2``
    (its ``loss_func``'s terms) times the pair's weight. The rewards are read at the last tokens
    of whole sequences (ms-swift's ``get_last_tokens``, which gathers the context-parallel shards
    with the gradient to this rank's own): each context-parallel rank weighs the whole loss with
    the whole pair weight."""
    packed = data.get("packed_seq_params")
    rewards = trainer.get_last_tokens(output_tensor, packed, data.get("attention_mask"))
    rewards = rewards.reshape(-1)
    k = mb["num_pairs"]
    chosen, rejected = rewards[:k], rewards[k : 2 * k]
    margin = data.pop("margin", None)
    shift = 0 if margin is None else margin.to(chosen).reshape_as(chosen)
    losses = -torch.nn.functional.logsigmoid(chosen - rejected - shift)
    center = trainer.args.center_rewards_coefficient
    if center is not None:
        losses = losses + center * (chosen + rejected) ** 2
    w = _pair_weights(mb["loss_weights"], mb["pair_ids"], mb.get("cu_seqlens"))[:k]
    loss = (w.to(losses.dtype) * losses).sum()
    report = {
        "loss": loss.detach().clone(),
        "rewards/accuracies": (chosen > rejected).float().mean(),
    }
    return loss, report


def _kto_loss(
    trainer: Any,
    mb: dict[str, Any],
    kl_step: torch.Tensor | None,
    output_tensor: torch.Tensor,
    *,
    data: dict,
    kl_data: dict,
    label: Any,
) -> tuple:
    """ms-swift's KTO loss of one micro-batch as the plugin's weighted sum: each example's loss
    (TRL's ``kto_loss``) times its weight; the KL baseline the step's (``kl_step``) or ms-swift's
    own per micro-batch (``None``)."""
    args = trainer.args
    _one_loss_type(args.loss_type, KTO_LOSS_TYPES, "KTO example")
    length = trainer._get_kto_length(data)
    policy = trainer._kto_get_logps(output_tensor, data, False, False, length)
    ref = trainer._kto_get_logps(output_tensor, data, False, True, length)
    if not args.calculate_KL:
        policy_kl, ref_kl = None, None
    elif kl_step is not None:  # the step's mean, through TRL's own mean over one value
        policy_kl, ref_kl = kl_step.reshape(1).to(policy.dtype), policy.new_zeros(1)
    else:
        policy_kl = trainer._kto_get_logps(output_tensor, kl_data, True, False, length)
        ref_kl = trainer._kto_get_logps(output_tensor, kl_data, True, True, length)
    desirable = torch.as_tensor(label, dtype=torch.bool, device=policy.device)
    losses, _, _, kl = trainer.dummy_kto_trainer.kto_loss(
        policy[desirable], policy[~desirable], policy_kl, ref[desirable], ref[~desirable], ref_kl
    )
    packed = data.get("packed_seq_params")
    weights = _cp_local(trainer, mb["loss_weights"], packed)
    w = _pair_weights(weights, mb["pair_ids"], _local_cu_seqlens(trainer, packed))
    w = w[: len(desirable)]
    # TRL orders the losses desirable first, then undesirable.
    w = torch.cat([w[desirable], w[~desirable]]).to(losses.dtype)
    loss = (w * losses).sum()
    return loss, {"loss": loss.detach().clone(), "kl": kl.reshape(()).detach()}


# ------------------------------------------------------------------------------ the step


def _kto_step_kl(trainer: Any, megatron: Callable, items: list[dict], model: Any,
                 num_microbatches: int, **kwargs: Any) -> torch.Tensor | None:  # fmt: skip
    """The step's KL baseline: a forward-only pass of ms-swift's own ``forward_step`` over the
    step's micro-batches, ``max(0, mean of (policy - reference) log-probs)`` over every KL
    completion of every data-parallel rank; None off the last pipeline stage."""
    from megatron.core import parallel_state as mpu

    sums: list[torch.Tensor] = []

    def record(output_tensor: torch.Tensor, *, data: dict, kl_data: dict, label: Any) -> tuple:
        length = trainer._get_kto_length(data)
        policy = trainer._kto_get_logps(output_tensor, kl_data, True, False, length)
        ref = trainer._kto_get_logps(output_tensor, kl_data, True, True, length)
        diff = (policy - ref).detach()
        sums.append(torch.stack([diff.sum(), diff.new_tensor(float(diff.numel()))]))
        return output_tensor.new_zeros(()), {}

    def forward_step(data_iterator: Any, model: Any) -> tuple:
        output, swift_loss = trainer.forward_step(data_iterator, model)
        return output, functools.partial(record, **swift_loss.keywords)

    megatron(
        forward_step_func=forward_step,
        data_iterator=iter([dict(item) for item in items]),
        model=model,
        num_microbatches=num_microbatches,
        forward_only=True,
        **kwargs,
    )
    if not sums:
        return None
    total = torch.stack(sums).sum(0)
    dist.all_reduce(total, group=mpu.get_data_parallel_group())
    return (total[0] / total[1].clamp(min=1)).clamp(min=0)


class _ForwardBackward:
    """What a trainer's ``train_step`` gets from ``get_forward_backward_func()`` while the switch
    is on: its preference step under :class:`LossFixSchedule`, its loss weighted per unit."""

    def __init__(self, schedule: LossFixSchedule, megatron: Callable, kto_kl: str) -> None:
        self.schedule, self._megatron, self.kto_kl = schedule, megatron, kto_kl

    def __call__(
        self,
        *,
        forward_step_func: Callable,
        data_iterator: Any,
        model: Any,
        num_microbatches: int,
        forward_only: bool = False,
        **kwargs: Any,
    ) -> Any:
        trainer = getattr(forward_step_func, "__self__", None)
        kind = "sft" if trainer is None or forward_only else _kind(trainer)
        if kind == "sft":  # not a preference step: Megatron's own schedule
            return self._megatron(forward_step_func=forward_step_func, data_iterator=data_iterator,
                                  model=model, num_microbatches=num_microbatches,
                                  forward_only=forward_only, **kwargs)  # fmt: skip
        if isinstance(data_iterator, (list, tuple)):
            raise ValueError(
                "the ms-swift adapter runs one model chunk per pipeline stage: unset "
                "virtual_pipeline_model_parallel_size, or disable the adapter"
            )
        items = [next(data_iterator) for _ in range(num_microbatches)]
        packed = bool(trainer.args.padding_free)
        mbs = [plugin_micro_batch(item, kind, packed) for item in items]
        kl_step = None
        if kind == "kto" and trainer.args.calculate_KL and self.kto_kl == "step":
            kl_step = _kto_step_kl(trainer, self._megatron, items, model, num_microbatches,
                                   **kwargs)  # fmt: skip
        if kind == "dpo" and trainer.args.rpo_alpha:
            from megatron.core import parallel_state as mpu

            # Whole sequences on every CP rank: count them over data-parallel ranks only.
            chosen = [mb["chosen_mask"] for mb in mbs]
            rpo = loss_weights(chosen, "token_mean", dp_group=mpu.get_data_parallel_group())
            for mb, w in zip(mbs, rpo, strict=True):
                mb[RPO_WEIGHTS] = w

        def forward_step(data_iterator: Any, model: Any) -> tuple:
            mb = next(data_iterator)
            # A copy: ms-swift's get_batch replaces the labels it shifts in the dict it reads.
            output, swift_loss = trainer.forward_step(iter([dict(mb[ITEM])]), model)
            if kind == "dpo":
                return output, functools.partial(_dpo_loss, trainer, mb, **swift_loss.keywords)
            if kind == "rm":
                return output, functools.partial(_rm_loss, trainer, mb, **swift_loss.keywords)
            return output, functools.partial(_kto_loss, trainer, mb, kl_step,
                                             **swift_loss.keywords)  # fmt: skip

        return self.schedule(forward_step_func=forward_step, data_iterator=iter(mbs),
                             model=model, num_microbatches=num_microbatches,
                             forward_only=False, **kwargs)  # fmt: skip


# ------------------------------------------------------------------------------ the switch


def enable(*, kto_kl: str = "step") -> Callable[[], None]:
    """The switch: from now on, in this process, ms-swift's DPO, KTO and reward-model trainers'
    ``train_step`` runs under the plugin (module docstring; call it before the first training step).
    ``kto_kl``: KTO's KL baseline over the ``step`` (default) or per ``micro_batch`` (ms-swift's
    own). Returns :func:`disable`."""
    from swift.megatron.trainers import base

    if kto_kl not in KTO_KL:
        raise ValueError(f"kto_kl must be one of {', '.join(KTO_KL)}, got {kto_kl!r}")
    schedule = LossFixSchedule(lossfix_config())
    _ORIGINAL.setdefault("train_step", base.BaseMegatronTrainer.__dict__["train_step"])
    released = _ORIGINAL["train_step"]

    @functools.wraps(released)
    def train_step(self: Any, train_data_iterator: Any) -> Any:
        if _kind(self) == "sft":  # before anything runs: other trainers are refused here
            return released(self, train_data_iterator)
        lookup = base.get_forward_backward_func
        base.get_forward_backward_func = lambda *a, **k: _ForwardBackward(
            schedule, lookup(*a, **k), kto_kl
        )
        try:
            return released(self, train_data_iterator)
        finally:
            base.get_forward_backward_func = lookup

    train_step.lossfix_schedule = schedule  # type: ignore[attr-defined]
    base.BaseMegatronTrainer.train_step = train_step
    return disable


def disable() -> None:
    """ms-swift's own ``train_step`` again (a no-op when the switch is off)."""
    from swift.megatron.trainers import base

    if "train_step" in _ORIGINAL:
        base.BaseMegatronTrainer.train_step = _ORIGINAL.pop("train_step")
