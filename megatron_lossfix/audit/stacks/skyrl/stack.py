"""``--stack skyrl``: SkyRL's own Megatron loss path under the audit's layouts.

Each rank builds the audit's tiny GPT for the layout and hands SkyRL's
``MegatronModelWrapper.forward_backward_mini_batch`` one mini-batch in SkyRL's micro-batch format
(sequences, attention mask, old and reference log-probs, advantages, loss mask over the response),
configured with SkyRL's own ``TrainerConfig`` (PPO ``regular`` policy loss, k3 KL and entropy with
coefficients above zero). Two rows per mode:

- ``skyrl``: as released: advantages pre-scaled on the driver by SkyRL's
  ``apply_loss_reduction_to_advantages_minibatch`` over the whole mini-batch (``prompt_mean``
  with the mini-batch's ``prompt_boundaries``), then SkyRL's ``loss_func`` with its
  ``num_microbatches x dp`` factor and per-micro-batch KL/entropy means, and the gradient sync
  SkyRL defers to its optimizer step (``run_pending_grad_sync``);
- ``skyrl+lossfix``: the same step through :class:`~megatron_lossfix.integrations.skyrl.adapter.
  LossFixModelWrapper` with raw advantages (and, for ``prompt_mean``, each row's prompt in the
  micro-batches, as :func:`~megatron_lossfix.integrations.skyrl.adapter.group_ids_from_boundaries`
  gives it).

The mini-batch's prompts are consecutive blocks of
:data:`~megatron_lossfix.audit.oracle_case.PROMPT_GROUP_SIZES` sequences, so that prompts
straddle DP ranks and micro-batches; every prompt has a loss token (where one has none, SkyRL's
``prompt_mean`` still counts it: docs/design.md §2).

Both are compared with one one-rank, one-micro-batch reference of the exact objective
``sum(w * (pg + kl_coef * kl - entropy_coef * entropy))`` with the plugin's weights ``w`` of the
mode (docs/design.md §2: regularizers use the same weights). ``terms`` picks what is audited
(:data:`TERMS`): ``all``; ``kl_entropy`` (zero advantages: the KL and entropy terms alone); or
``sft``, SkyRL's SFT path (``loss_fn="cross_entropy"``, its loss mask divided by the mini-batch's
loss-token count as its ``DefaultCollator`` does) against ``sum(w * nll)``, ``token_mean`` only.

The harness (data, layouts, reference) is ours; SkyRL's code runs unchanged from its package.
SkyRL 0.4.0's model wrapper imports two functions from ``megatron.bridge.peft.utils`` that no
Megatron Bridge on the package index has yet (SkyRL pins a development Bridge); where they are
missing, :func:`provide_bridge_finalizer` supplies what they are for a model without adapters
(Megatron-Core's ``finalize_model_grads``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

import torch

from megatron_lossfix.audit.matrix import MatrixLayout, parse_layout
from megatron_lossfix.audit.oracle import OracleCase, microbatch_plan, relative_error
from megatron_lossfix.audit.oracle_case import prompt_groups
from megatron_lossfix.audit.report import AuditReport, Progress, each_layout
from megatron_lossfix.audit.stacks.modes import mode_rows

__all__ = [
    "DISTRIBUTION",
    "ENTROPY_COEF",
    "KL_COEF",
    "LAYOUTS",
    "MIN_VERSION",
    "MODES",
    "ROWS",
    "TERMS",
    "provide_bridge_finalizer",
    "run_stack",
    "skyrl_batch",
    "skyrl_layout_grads",
    "skyrl_reference",
]

DISTRIBUTION = "skyrl"
#: The oldest SkyRL whose Megatron path this stack runs (``prompt_mean``, the deferred sync).
MIN_VERSION = "0.4"
#: SkyRL's ``algorithm.loss_reduction`` values; each is the plugin mode of the same name
#: (``prompt_mean``: the alias of ``group_mean``).
MODES: tuple[str, ...] = (
    "token_mean",
    "token_mean_legacy",
    "sequence_mean",
    "seq_mean_token_sum_norm",
    "prompt_mean",
)
ROWS: tuple[str, ...] = ("skyrl", "skyrl+lossfix")
#: ``--terms``: what a run audits (module docstring) -> the modes it allows.
TERMS: dict[str, tuple[str, ...]] = {"all": MODES, "kl_entropy": MODES, "sft": ("token_mean",)}
#: SkyRL's gradient under a layout against its own one-rank, one-micro-batch gradient: its
#: layout dependence alone, apart from how its objective differs from the exact one.
SELF_ROW = "skyrl-vs-1rank"
KL_COEF = 0.1
ENTROPY_COEF = 0.05
#: ``--stack skyrl`` without ``--layouts``: one rank (SkyRL's definitions alone), DP, PP, CP, TP
#: and EP2 MoE.
LAYOUTS: tuple[str, ...] = ("dp1-m1", "dp2-m3", "pp2-m4", "cp2-m3", "tp2-m3", "ep2-dp2-m3")


def stack_case(opts: Any, layout: MatrixLayout) -> OracleCase:
    """The audit's case for ``layout``, with what SkyRL's path needs on CPU: CP runs SkyRL's
    packed (THD) path, whose model call passes no position ids, so CP layouts use a model with
    no attention and no position embedding."""
    case = opts.case(layout)
    model = dict(case.model_kwargs)
    if not model.get("num_experts"):
        # SkyRL's worker sets it on its model provider: micro-batches are trimmed to their
        # longest sequence, so pipeline stages exchange activations of varying length. (Megatron
        # refuses it with the allgather dispatcher; MoE rows keep a fixed length, see
        # skyrl_batch.)
        model.update(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
    if layout.cp > 1:
        model["position_embedding_type"] = "none"
    return dataclasses.replace(case, model_kwargs=model)


def provide_bridge_finalizer() -> None:
    """Give ``megatron.bridge.peft.utils`` the two functions SkyRL 0.4.0's model wrapper
    imports where the installed Megatron Bridge (or none) lacks them: for a model without
    adapters, Bridge's ``finalize_model_grads_with_expert_adapter_sync`` is Megatron-Core's
    ``finalize_model_grads`` (its extra sum of expert-parallel adapter gradients has nothing to
    sum), and ``enable_expert_parallel_grad_sync_in_finalize`` finds no adapter parameters."""
    import sys
    import types

    from megatron.core.distributed import finalize_model_grads

    names = ("enable_expert_parallel_grad_sync_in_finalize",
             "finalize_model_grads_with_expert_adapter_sync")  # fmt: skip
    try:
        from megatron.bridge.peft import utils
    except ImportError:
        utils = None
        for name in ("megatron.bridge", "megatron.bridge.peft", "megatron.bridge.peft.utils"):
            sys.modules.setdefault(name, types.ModuleType(name))
        utils = sys.modules["megatron.bridge.peft.utils"]
        sys.modules["megatron.bridge.peft"].utils = utils
        sys.modules["megatron.bridge"].peft = sys.modules["megatron.bridge.peft"]
    if all(hasattr(utils, name) for name in names):
        return

    def no_adapters(model: Any) -> int:
        return 0

    def finalize(model: Any, num_tokens: Any = None, **kwargs: Any) -> None:
        finalize_model_grads(model, num_tokens, **kwargs)

    utils.enable_expert_parallel_grad_sync_in_finalize = no_adapters
    utils.finalize_model_grads_with_expert_adapter_sync = finalize


# ------------------------------------------------------------------------------ data


def skyrl_batch(case: OracleCase, vocab_size: int, terms: str = "all") -> dict[str, Any]:
    """The mini-batch in SkyRL's layout: a prompt of ``seq_length // 4`` tokens, then a response
    of variable length (some empty) padded on the right; ``loss_mask`` and the log-probs cover
    the last ``num_actions`` positions."""
    gen = torch.Generator().manual_seed(case.seed)
    b, s = case.global_batch_size, case.seq_length
    prompt = s // 4
    num_actions = s - prompt
    sequences = torch.randint(0, vocab_size, (b, s), generator=gen)
    response = torch.randint(0, num_actions + 1, (b,), generator=gen)
    response[::7] = 0  # sequences with no loss token
    pos = torch.arange(s)
    attention_mask = (pos[None, :] < (prompt + response)[:, None]).long()
    if case.model_kwargs.get("num_experts"):
        # Megatron's allgather token dispatcher (the one gloo can run) needs the same token
        # count on every expert-parallel rank; SkyRL trims each micro-batch to its longest
        # sequence, so MoE runs attend to whole rows (the loss masks still vary).
        attention_mask = torch.ones_like(attention_mask)
    loss_mask = (torch.arange(num_actions)[None, :] < response[:, None]).float()
    group_ids, num_groups = prompt_groups(b)
    base = -torch.log(torch.tensor(float(vocab_size)))
    old = base + 0.3 * torch.randn(b, num_actions, generator=gen)
    ref = base + 0.3 * torch.randn(b, num_actions, generator=gen)
    adv = torch.randn(b, 1, generator=gen).expand(b, num_actions).clone()
    if terms == "kl_entropy":
        adv.zero_()
    return {
        "sequences": sequences,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0) * attention_mask,
        "num_actions": num_actions,
        "old_action_log_probs": old,
        "base_action_log_probs": ref,
        "advantages": adv * loss_mask,
        "loss_mask": loss_mask,
        "group_ids": group_ids,
        "num_groups": num_groups,
    }


def _trainer_config(mode: str, case: OracleCase, cp: int) -> Any:
    """SkyRL's own TrainerConfig for the audit: PPO ``regular``, k3 KL and entropy on."""
    from skyrl.train.config import TrainerConfig

    cfg = TrainerConfig()
    # SkyRL supports CP only on its packed (THD) path; the unpacked path elsewhere.
    cfg.remove_microbatch_padding = cp > 1
    alg = cfg.algorithm
    alg.loss_reduction = mode
    alg.policy_loss_type = "regular"
    alg.use_kl_loss, alg.kl_loss_coef, alg.kl_estimator_type = True, KL_COEF, "k3"
    alg.use_entropy_loss, alg.entropy_loss_coef = True, ENTROPY_COEF
    alg.max_seq_len = int(case.norm_constant)
    return cfg


def _boundaries(group_ids: torch.Tensor) -> list[tuple[int, int]]:
    """SkyRL's ``prompt_boundaries`` of consecutive group ids: ``(start, end)`` per prompt."""
    ids = group_ids.tolist()
    starts = [i for i in range(len(ids)) if i == 0 or ids[i] != ids[i - 1]]
    return list(zip(starts, [*starts[1:], len(ids)], strict=True))


def _micro_batches(
    batch: dict[str, Any],
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    sizes: Sequence[int],
    start: int,
    groups: bool,
) -> list[dict[str, Any]]:
    """This DP rank's micro-batches, as SkyRL's worker builds them (``forward_backward``);
    with ``groups`` each also carries its rows' ``group_ids`` and the mini-batch's
    ``num_groups`` (what the adapter reads for ``prompt_mean``)."""
    out, at = [], start
    own = ("advantages", "loss_mask", "group_ids", "num_groups")
    for size in sizes:
        part = {
            k: (v[at : at + size] if torch.is_tensor(v) else v)
            for k, v in batch.items()
            if k not in own
        }
        if groups:
            part.update(
                group_ids=batch["group_ids"][at : at + size], num_groups=batch["num_groups"]
            )
        part.update(
            advantages=advantages[at : at + size],
            loss_mask=loss_mask[at : at + size],
            rollout_action_logprobs=None,
            rollout_expert_indices=None,
            action_mask=None,
            num_microbatches=len(sizes),
            num_real_microbatches=len(sizes),
        )
        out.append(part)
        at += size
    return out


# ------------------------------------------------------------------------------ per rank


def _run_row(
    row: str, mode: str, case: OracleCase, chunks: list, batch: dict, plan: list, terms: str
) -> None:
    """One SkyRL training step (forward and backward) of ``row`` on this rank."""
    from megatron.core import parallel_state as ps

    provide_bridge_finalizer()
    from skyrl.backends.skyrl_train.utils.ppo_utils import (
        PolicyLossRegistry,
        apply_loss_reduction_to_advantages_minibatch,
    )
    from skyrl.backends.skyrl_train.workers.megatron.megatron_model_wrapper import (
        MegatronModelWrapper,
    )

    from megatron_lossfix.integrations.skyrl import adapter

    cfg = _trainer_config(mode, case, ps.get_context_parallel_world_size())
    dp_rank = ps.get_data_parallel_rank()
    sizes = plan[dp_rank]
    wrapper = MegatronModelWrapper(
        config=cfg,
        actor_module=chunks,
        policy_loss_fn=PolicyLossRegistry.get(cfg.algorithm.policy_loss_type),
    )
    loss_mask, loss_fn = batch["loss_mask"], None
    if terms == "sft":
        loss_fn = "cross_entropy"
        if row == "skyrl":  # DefaultCollator: the mask over the mini-batch's loss-token count
            loss_mask = loss_mask / loss_mask.sum().clamp(min=1)
    boundaries = _boundaries(batch["group_ids"])
    if row == "skyrl":
        # The driver's pre-scaling over the whole mini-batch (trainer._normalize_advantages).
        advantages = apply_loss_reduction_to_advantages_minibatch(
            advantages=batch["advantages"],
            loss_mask=batch["loss_mask"],
            loss_reduction=mode,
            micro_batch_size=sizes[0],
            max_seq_len=cfg.algorithm.max_seq_len,
            prompt_boundaries=boundaries if mode == "prompt_mean" else None,
        )
    else:
        # The changes a SkyRL user makes (integrations/skyrl/adapter.py).
        advantages = adapter.raw_advantages(batch["advantages"], batch["loss_mask"])
        wrapper = adapter.LossFixModelWrapper.from_wrapper(wrapper)
        ids = adapter.group_ids_from_boundaries(boundaries, batch["sequences"].shape[0])
        batch = {**batch, "group_ids": ids.to(batch["group_ids"].device)}
    start = sum(sum(p) for p in plan[:dp_rank])
    groups = row != "skyrl" and mode == "prompt_mean"
    mbs = _micro_batches(batch, advantages, loss_mask, sizes, start, groups)
    wrapper.forward_backward_mini_batch(
        mbs, seq_len=batch["sequences"].shape[1], micro_batch_size=sizes[0], loss_fn=loss_fn
    )
    # SkyRL defers Megatron's gradient reduction to its optimizer step.
    wrapper.run_pending_grad_sync()


def skyrl_layout_grads(
    layout: Any,
    case: OracleCase,
    modes: Sequence[str],
    num_microbatches: int,
    terms: str = "all",
    rows: Sequence[str] = ROWS,
) -> dict[tuple[str, str], dict[str, torch.Tensor]] | None:
    """Every (row, mode) step under ``layout``; the full gradients on global rank 0."""
    from megatron.core import parallel_state as ps

    from megatron_lossfix.audit import tiny_gpt

    tiny_gpt.init_layout(layout)
    chunks, config = tiny_gpt.case_tiny_gpt(layout, case)
    batch = skyrl_batch(case, config.vocab_size, terms)
    batch = {
        k: v.to(next(chunks[0].parameters()).device) if torch.is_tensor(v) else v
        for k, v in batch.items()
    }
    plan = microbatch_plan(case, ps.get_data_parallel_world_size(), num_microbatches)
    out = {}
    for mode in modes:
        for row in rows:
            tiny_gpt.set_deterministic_params(chunks, case.seed)
            for chunk in chunks:
                chunk.zero_grad_buffer()
            _run_row(row, mode, case, chunks, batch, plan, terms)
            out[(row, mode)] = tiny_gpt.gather_full_grads(chunks)
    return out if torch.distributed.get_rank() == 0 else None


def skyrl_reference(
    case: OracleCase, mode: str, plan: Sequence[Sequence[int]], terms: str = "all"
) -> dict[str, torch.Tensor]:
    """One rank, one micro-batch: the gradient of the exact objective (module docstring)."""
    from megatron_lossfix.audit.oracle import reference_weights, set_moe_aux_scale
    from megatron_lossfix.audit.tiny_gpt import gather_full_grads, one_rank_tiny_gpt

    model, config = one_rank_tiny_gpt(case)
    device = next(model.parameters()).device
    batch = {
        k: v.to(device) if torch.is_tensor(v) else v
        for k, v in skyrl_batch(case, config.vocab_size, terms).items()
    }
    # The padding mask SkyRL's unpacked path passes: with Megatron's local attention (no
    # Transformer Engine) a given mask replaces the causal one, so the reference attends alike.
    mask = None
    if case.model_kwargs.get("position_embedding_type") != "none":
        mask = (batch["attention_mask"] == 0)[:, None, None, :]
    logits = model(batch["sequences"], batch["position_ids"], mask).float()
    a = batch["num_actions"]
    logp = torch.log_softmax(logits, dim=-1)
    token_lp = logp[:, :-1].gather(-1, batch["sequences"][:, 1:, None]).squeeze(-1)[:, -a:]
    entropy = -(logp.exp() * logp).sum(-1)[:, -a - 1 : -1]
    ratio = torch.exp(token_lp - batch["old_action_log_probs"])
    adv = batch["advantages"]
    pg = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    d = batch["base_action_log_probs"] - token_lp
    kl = torch.exp(d) - d - 1
    w = reference_weights(case, mode, plan)(batch["loss_mask"])
    if terms == "sft":
        loss = -(w * token_lp).sum()
    else:
        loss = (w * pg).sum() + KL_COEF * (w * kl).sum() - ENTROPY_COEF * (w * entropy).sum()
    set_moe_aux_scale(config, device)
    loss.backward()
    model.finish_grad_sync()
    return gather_full_grads([model])


# ------------------------------------------------------------------------------ the driver


def run_stack(
    opts: Any,
    options: dict[str, Any],
    *,
    pool: Any,
    progress: IO[str] | None,
    worker: Callable[..., Any] = skyrl_layout_grads,
) -> AuditReport:
    """Rows ``skyrl`` and ``skyrl+lossfix`` (worst mode per layout), one row per mode where
    there are several (:func:`~megatron_lossfix.audit.stacks.modes.mode_rows`), and
    ``skyrl-vs-1rank:<mode>`` (SkyRL against its own one-rank gradient: its layout dependence
    alone); ``worker`` runs on every rank (tests bypass the adapter through it)."""
    started = time.perf_counter()
    modes, terms = tuple(opts.modes), opts.terms
    per_mode = mode_rows(ROWS, modes)
    # token_mean_legacy is defined by the micro-batch split: it has no layout-free value.
    own_modes = [m for m in modes if m != "token_mean_legacy"]
    report = AuditReport(
        options=options,
        modes=[*ROWS, *per_mode.values(), *(f"{SELF_ROW}:{m}" for m in own_modes)],
        layouts=[{**dataclasses.asdict(lay), "world_size": lay.world_size} for lay in opts.layouts],
        baselines=(ROWS[0], *(f"{r}:{m}" for r in (ROWS[0], SELF_ROW) for m in modes)),
    )
    bar = Progress(len(opts.layouts), progress)
    refs: dict[tuple, dict[str, torch.Tensor]] = {}
    own: dict[tuple, dict[str, torch.Tensor]] = {}
    one_rank = parse_layout("dp1-m1").parallel()

    def measure(lay: MatrixLayout) -> None:
        case = stack_case(opts, lay)
        plan = microbatch_plan(case, lay.dp, lay.num_microbatches)
        got = pool.run(
            worker, lay.world_size, lay.parallel(), case, modes, lay.num_microbatches, terms
        )[0]
        worst = dict.fromkeys(ROWS, 0.0)
        for mode in modes:
            key = (repr(case), mode, repr(plan) if mode == "token_mean_legacy" else None)
            if key not in refs:
                refs[key] = pool.run(skyrl_reference, 1, case, mode, plan, terms)[0]
            for row in ROWS:
                err = relative_error(got[(row, mode)], refs[key])
                worst[row] = max(worst[row], err)
                if (row, mode) in per_mode:
                    report.add_result(per_mode[row, mode], lay, {"error": err}, opts.tolerance)
            if mode in own_modes:
                if key[:2] not in own:
                    own[key[:2]] = pool.run(
                        skyrl_layout_grads, 1, one_rank, case, (mode,), 1, terms, ROWS[:1]
                    )[0][(ROWS[0], mode)]
                err = relative_error(got[(ROWS[0], mode)], own[key[:2]])
                report.add_result(f"{SELF_ROW}:{mode}", lay, {"error": err}, opts.tolerance)
        for row, err in worst.items():
            report.add_result(row, lay, {"error": err}, opts.tolerance)

    each_layout(report, bar, [(lay,) for lay in opts.layouts], measure)
    report.elapsed_s = time.perf_counter() - started
    return report
