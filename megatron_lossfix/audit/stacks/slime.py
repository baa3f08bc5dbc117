"""``--stack slime``: slime's own Megatron loss path under the audit's layouts.

What runs is slime's code, unchanged, from the installed package (slime is installed from its
source: docs/slime.md):

* ``slime.backends.megatron_utils.data``: ``DataIterator`` (each DP rank's micro-batches by
  sample index) and ``get_batch`` (packing into one THD row, both context-parallel layouts:
  the zigzag ring slicing and ``--allgather-cp``, the loss masks);
* ``slime.backends.megatron_utils.loss.loss_function``: ``policy_loss_function`` (PPO clip,
  entropy bonus, ``low_var_kl`` KL loss), the reducer ``get_sum_of_sample_mean`` with the
  step's ``rollout_mask_sums``, and its normalization: ``num_microbatches /
  step_global_batch_size x (DP x CP)`` by default, ``x CP`` with ``num_tokens =
  sum(clamp_min(loss_mask.sum(), 1))`` under ``--calculate-per-token-loss``.

The harness (ours): the rollout data as slime's actor holds it (old and reference log-probs and
advantages sliced for this CP rank with slime's ``slice_log_prob_with_cp``, ``rollout_ids``,
``rollout_mask_sums`` as slime's rollout manager computes them), slime's ``forward_step`` of
``train_one_step`` restated (``get_batch``, the model call, ``partial(loss_function, ...)``;
``train_one_step`` itself also runs slime's optimizer step and releases the gradients), and
the schedule ``train_one_step`` looks up on slime's ``model`` module: Megatron-Core's, or the
adapter's once :func:`megatron_lossfix.integrations.slime.enable` ran (the switch a slime user
sets with ``--custom-megatron-init-path``). The tiny GPT runs without attention and position
embedding: slime feeds packed sequences (THD) with no position ids, which Megatron runs on CPU
only without attention.

The batch: 24 samples, prompts of 2-5 tokens, responses of 1-12 (uneven), some responses with a
masked tail, and samples 0, 7, 14, 15, 16, 17 and 21 fully masked (a filtered or removed
sample: slime keeps its response and zeroes its loss mask). Modes (:data:`MODES`):

* ``per_sample``: slime's default setting, one sample per rollout;
* ``per_rollout``: the default setting with rollouts of several samples (compact or subagent
  rollouts: :data:`~megatron_lossfix.audit.oracle_case.PROMPT_GROUP_SIZES`, rollout 3 fully
  masked), whose samples straddle DP ranks and micro-batches;
* ``per_token``: ``--calculate-per-token-loss``.

Rows per mode: ``slime`` (as released) against the exact objective of its setting (the
plugin's weights; for the default setting times (rollouts with a loss token / all rollouts),
since slime divides by every rollout of the step), ``slime-vs-1rank`` (against slime's own
one-rank, one-micro-batch gradient: its layout dependence alone) and ``slime+lossfix``
(:mod:`megatron_lossfix.integrations.slime`) against the plugin's exact objective. Context
parallel layouts run in both of slime's CP layouts: ``cp2-m3`` (ring, zigzag) and
``cp2-m3+allgather``.
"""

from __future__ import annotations

import dataclasses
import time
from argparse import Namespace
from collections.abc import Callable, Sequence
from functools import partial
from typing import IO, Any

import torch

from megatron_lossfix.audit.matrix import MatrixLayout, parse_layout
from megatron_lossfix.audit.oracle import OracleCase, microbatch_plan, relative_error
from megatron_lossfix.audit.oracle_case import prompt_groups
from megatron_lossfix.audit.report import AuditReport, Progress
from megatron_lossfix.audit.stacks.modes import StackMode

__all__ = [
    "ALLGATHER",
    "DISTRIBUTION",
    "LAYOUTS",
    "MODES",
    "ROWS",
    "phantom_tokens",
    "run_stack",
    "slime_args",
    "slime_layout_grads",
    "slime_reference",
    "slime_rollout",
]

DISTRIBUTION = "slime"
#: The slime release whose loss path this stack was measured on (its source at 624b824).
MIN_VERSION = "0.3.1"
#: How to install what the stack runs (slime is not on the package index).
INSTALL = (
    "pip install -e .[slime] (from this clone), then slime from its source: "
    'pip install --no-deps "$SLIME_SOURCE" (a clone of THUDM/slime; docs/slime.md)'
)
#: slime's settings -> the plugin's mode; the default setting divides by every rollout.
MODES: dict[str, StackMode] = {
    "per_sample": StackMode(plugin_mode="sequence_mean", divides_by_batch_size=True),
    "per_rollout": StackMode(plugin_mode="group_mean", divides_by_batch_size=True),
    "per_token": StackMode(plugin_mode="token_mean"),
}
ROWS: tuple[str, ...] = ("slime", "slime+lossfix")
SELF_ROW = "slime-vs-1rank"
#: The suffix of a CP layout run in slime's ``--allgather-cp`` layout.
ALLGATHER = "+allgather"
#: ``--stack slime`` without ``--layouts``: one rank, DP, PP, TP and CP (both CP layouts).
LAYOUTS: tuple[str, ...] = ("dp1-m1", "dp2-m3", "pp2-m3", "tp2-m3", "cp2-m3")
#: Fully masked samples of the batch (rows 15-17: rollout 3 of ``per_rollout``).
MASKED_SAMPLES: tuple[int, ...] = (0, 7, 14, 15, 16, 17, 21)
KL_COEF = 0.1
ENTROPY_COEF = 0.05
EPS_CLIP, EPS_CLIP_HIGH = 0.2, 0.28
#: slime's get_batch pads each packed row to a multiple of TP x this.
PAD_MULTIPLIER = 4
#: What slime's forward_step asks get_batch for (train_one_step).
BATCH_KEYS: tuple[str, ...] = (
    "tokens",
    "multimodal_train_inputs",
    "packed_seq_params",
    "total_lengths",
    "response_lengths",
    "loss_masks",
    "log_probs",
    "ref_log_probs",
    "values",
    "advantages",
    "returns",
    "rollout_log_probs",
    "teacher_log_probs",
    "rollout_mask_sums",
)


def stack_case(opts: Any, layout: MatrixLayout) -> OracleCase:
    """The audit's case for ``layout`` with the model slime's packed batches run on here."""
    case = opts.case(layout)
    model = dict(case.model_kwargs)
    model.update(no_attention=True, position_embedding_type="none", variable_seq_lengths=True)
    # Megatron refuses variable lengths with its default (allgather) token dispatcher.
    model.setdefault("moe_token_dispatcher_type", "alltoall")
    return dataclasses.replace(case, model_kwargs=model)


# ------------------------------------------------------------------------------ data


def slime_args(mode: str, allgather_cp: bool = False) -> Namespace:
    """slime's parsed arguments, as far as its loss path reads them: GRPO-style PPO with an
    entropy bonus and a ``low_var_kl`` KL loss."""
    return Namespace(
        loss_type="policy_loss",
        calculate_per_token_loss=mode == "per_token",
        allgather_cp=allgather_cp,
        recompute_loss_function=False,
        advantage_estimator="grpo",
        use_rollout_logprobs=False,
        eps_clip=EPS_CLIP,
        eps_clip_high=EPS_CLIP_HIGH,
        eps_clip_c=None,
        use_opsm=False,
        get_mismatch_metrics=False,
        use_tis=False,
        custom_pg_loss_reducer_function_path=None,
        entropy_coef=ENTROPY_COEF,
        use_kl_loss=True,
        kl_loss_coef=KL_COEF,
        kl_loss_type="low_var_kl",
        use_unbiased_kl=False,
        rollout_temperature=1.0,
        rollout_top_p=1.0,
        log_probs_chunk_size=-1,
        data_pad_size_multiplier=PAD_MULTIPLIER,
        save_debug_train_data=None,
    )


def slime_rollout(case: OracleCase, vocab_size: int, mode: str) -> dict[str, Any]:
    """The step's whole rollout data, every sample's fields full length (on the CPU)."""
    gen = torch.Generator().manual_seed(case.seed)
    b, s = case.global_batch_size, case.seq_length
    prompts = torch.randint(2, 6, (b,), generator=gen)
    tokens, masks, old, ref, adv = [], [], [], [], []
    base = -torch.log(torch.tensor(float(vocab_size)))
    for i in range(b):
        p = int(prompts[i])
        r = int(torch.randint(1, s - p + 1, (1,), generator=gen))
        tokens.append(torch.randint(0, vocab_size, (p + r,), generator=gen))
        mask = torch.ones(r, dtype=torch.int)
        if i % 5 == 2 and r > 2:  # a masked tail (e.g. a tool call's output)
            mask[r // 2 :] = 0
        if i in MASKED_SAMPLES:
            mask.zero_()
        masks.append(mask)
        old.append(base + 0.3 * torch.randn(r, generator=gen))
        ref.append(base + 0.3 * torch.randn(r, generator=gen))
        adv.append(torch.randn((), generator=gen).expand(r).clone())
    if mode == "per_rollout":
        rollout_ids = prompt_groups(b)[0].tolist()
    else:
        rollout_ids = list(range(b))
    # slime's rollout manager (_convert_samples_to_train_data): per-rollout mask totals.
    totals: dict[int, int] = {}
    for rid, m in zip(rollout_ids, masks, strict=True):
        totals[rid] = totals.get(rid, 0) + int(m.sum())
    return {
        "tokens": tokens,
        "total_lengths": [len(t) for t in tokens],
        "response_lengths": [len(m) for m in masks],
        "loss_masks": masks,
        "log_probs": old,
        "ref_log_probs": ref,
        "advantages": adv,
        "rollout_ids": rollout_ids,
        "rollout_mask_sums": torch.tensor([float(totals[r]) for r in rollout_ids]),
        "num_rollouts": len(totals),
    }


def phantom_tokens(case: OracleCase) -> dict[str, float]:
    """The batch's loss tokens and the phantom tokens slime's per-token count adds (one per
    fully masked sample), and the factor by which that shrinks its gradient."""
    data = slime_rollout(case, 264, "per_token")
    real = sum(int(m.sum()) for m in data["loss_masks"])
    slime = sum(max(int(m.sum()), 1) for m in data["loss_masks"])
    return {
        "loss_tokens": real,
        "slime_num_tokens": slime,
        "phantom_tokens": slime - real,
        "gradient_scale": real / slime,
    }


def _local_rollout(data: dict[str, Any], indices: Sequence[int], device: Any) -> dict[str, Any]:
    """This DP rank's rollout data as slime's actor holds it: tensors on the device, the
    per-token fields sliced for this CP rank (slime's ``slice_log_prob_with_cp``)."""
    from slime.backends.megatron_utils.cp_utils import slice_log_prob_with_cp

    out: dict[str, Any] = {}
    lengths = [(data["total_lengths"][i], data["response_lengths"][i]) for i in indices]
    for key in ("log_probs", "ref_log_probs", "advantages"):
        out[key] = [
            slice_log_prob_with_cp(data[key][i], t, r).to(device)
            for i, (t, r) in zip(indices, lengths, strict=True)
        ]
    out["tokens"] = [data["tokens"][i].to(device) for i in indices]
    out["loss_masks"] = [data["loss_masks"][i].to(device) for i in indices]
    out["total_lengths"] = [t for t, _ in lengths]
    out["response_lengths"] = [r for _, r in lengths]
    out["rollout_ids"] = [data["rollout_ids"][i] for i in indices]
    out["rollout_mask_sums"] = data["rollout_mask_sums"][list(indices)].to(device)
    return out


# ------------------------------------------------------------------------------ per rank


def use_cpu_accelerator() -> None:
    """Where no GPU is visible, give slime a CPU device through its own accelerator registry
    (``slime.utils.accelerator.register_accelerator``; slime registers CUDA and MUSA only):
    its ``get_batch`` asks the accelerator where to put ``cu_seqlens``."""
    if torch.cuda.is_available():
        return
    from slime.utils import accelerator
    from slime.utils.accelerator.base import Accelerator

    class CPUAccelerator(Accelerator):
        name = device_type = "cpu"
        communication_backend_name = "gloo"

        def is_available(self) -> bool:
            return True

        def device(self, index: Any = None) -> torch.device:
            return torch.device("cpu")

        def device_name(self, index: Any = None) -> str:
            return "cpu"

        def set_device(self, index: Any) -> None:
            return None

        def current_device(self) -> str:
            return "cpu"

        def device_count(self) -> int:
            return 1

        def synchronize(self, device: Any = None) -> None:
            return None

        def current_stream(self, device: Any = None) -> Any:
            return None

        def default_stream(self, device: Any = None) -> Any:
            return None

        def empty_cache(self) -> None:
            return None

        def mem_get_info(self, device: Any = None) -> tuple[int, int]:
            return (0, 0)

        def memory_allocated(self, device: Any = None) -> int:
            return 0

        def memory_reserved(self, device: Any = None) -> int:
            return 0

    accelerator.register_accelerator("cpu", CPUAccelerator, lambda: True, priority=-1)
    accelerator.set_accelerator(CPUAccelerator())


def _forward_step(args: Namespace, num_microbatches: int, gbs: int, it: Any, model: Any) -> tuple:
    """slime's ``train_one_step`` ``forward_step``, restated: ``get_batch``, the model call,
    and ``partial(loss_function, args, batch, num_microbatches, step_global_batch_size)``."""
    from slime.backends.megatron_utils.data import get_batch
    from slime.backends.megatron_utils.loss import loss_function

    batch = get_batch(it, list(BATCH_KEYS), args.data_pad_size_multiplier, args.allgather_cp)
    output = model(
        input_ids=batch["tokens"],
        position_ids=None,
        attention_mask=None,
        labels=None,
        packed_seq_params=batch["packed_seq_params"],
        loss_mask=batch["full_loss_masks"],
    )
    return output, partial(loss_function, args, batch, num_microbatches, gbs)


def _run_row(row: str, mode: str, chunks: list, data: dict, plan: list, allgather: bool) -> None:
    """One slime training step (forward and backward, gradients reduced) of ``row``."""
    from megatron.core import parallel_state as ps
    from slime.backends.megatron_utils import model as slime_model
    from slime.backends.megatron_utils.data import DataIterator

    from megatron_lossfix.integrations import slime as adapter

    args = slime_args(mode, allgather)
    dp_rank = ps.get_data_parallel_rank()
    start = sum(sum(p) for p in plan[:dp_rank])
    local_n = sum(plan[dp_rank])
    device = next(chunks[0].parameters()).device
    rollout = _local_rollout(data, range(start, start + local_n), device)
    bounds, at = [], 0
    for size in plan[dp_rank]:
        bounds.append(list(range(at, at + size)))
        at += size
    iterators = [DataIterator(rollout, bounds) for _ in chunks]
    step = partial(_forward_step, args, len(bounds), data["num_rollouts"])
    for chunk in chunks:
        chunk.zero_grad_buffer()
    # train_one_step looks its schedule up on slime's model module when the step starts: the
    # adapted row goes through the documented switch (enable), undone after the row.
    megatrons = slime_model.get_forward_backward_func
    if row != "slime":
        adapter.enable(args)
    try:
        slime_model.get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks,
            num_microbatches=len(bounds),
            seq_length=data["max_tokens"],
            micro_batch_size=1,
            forward_only=False,
        )
    finally:
        slime_model.get_forward_backward_func = megatrons


def slime_layout_grads(
    layout: Any,
    case: OracleCase,
    modes: Sequence[str],
    num_microbatches: int,
    allgather: bool = False,
    rows: Sequence[str] = ROWS,
) -> dict[tuple[str, str], dict[str, torch.Tensor]] | None:
    """Every (row, mode) step under ``layout``; the full gradients on global rank 0."""
    from megatron.core import parallel_state as ps

    from megatron_lossfix.audit import tiny_gpt

    use_cpu_accelerator()
    tiny_gpt.init_layout(layout)
    models: dict[bool, tuple[list, Any]] = {}
    plan = microbatch_plan(case, ps.get_data_parallel_world_size(), num_microbatches)
    out = {}
    for mode in modes:
        per_token = mode == "per_token"
        if per_token not in models:  # Megatron's DDP fixes its gradient scaling when built
            models[per_token] = tiny_gpt.build_tiny_gpt(
                layout, seq_len=case.seq_length, calculate_per_token_loss=per_token,
                **case.model_kwargs,
            )  # fmt: skip
        chunks, config = models[per_token]
        data = slime_rollout(case, config.vocab_size, mode)
        data["max_tokens"] = sum(data["total_lengths"])
        for row in rows:
            tiny_gpt.set_deterministic_params(chunks, case.seed)
            _run_row(row, mode, chunks, data, plan, allgather)
            out[(row, mode)] = tiny_gpt.gather_full_grads(chunks)
    return out if torch.distributed.get_rank() == 0 else None


def slime_reference(case: OracleCase, mode: str) -> dict[str, torch.Tensor]:
    """One rank, one forward pass: the gradient of the exact objective of ``mode``,
    ``sum(w * (pg - entropy_coef * entropy + kl_coef * kl))`` with the plugin's weights ``w``
    (for slime's default setting times the share of rollouts with a loss token: the objective
    slime's setting means, which the ``slime`` rows are held to), written out here."""
    from megatron_lossfix.audit.tiny_gpt import (
        Layout,
        build_tiny_gpt,
        gather_full_grads,
        init_layout,
        set_deterministic_params,
    )
    from megatron_lossfix.losses import loss_weights

    layout = init_layout(Layout())
    chunks, config = build_tiny_gpt(layout, seq_len=case.seq_length, **case.model_kwargs)
    set_deterministic_params(chunks, case.seed)
    model = chunks[0]
    model.zero_grad_buffer()
    data = slime_rollout(case, config.vocab_size, mode)
    rows = len(data["tokens"])
    width = max(data["response_lengths"])
    mask = torch.zeros(rows, width)
    for i, m in enumerate(data["loss_masks"]):
        mask[i, : len(m)] = m.float()
    ids = torch.tensor(data["rollout_ids"])
    stack_mode = MODES[mode]
    kwargs: dict[str, Any] = {"rank_local": True}
    if stack_mode.plugin_mode == "group_mean":
        kwargs.update(group_ids=[ids], num_groups=data["num_rollouts"])
    (w,) = loss_weights([mask], stack_mode.plugin_mode, **kwargs)
    tokens = torch.cat(data["tokens"])[None]
    logits = model(tokens, None, None).float()[0]
    logp_all = torch.log_softmax(logits, dim=-1)
    loss = logits.new_zeros(())
    at = 0
    for i in range(rows):
        t, r = data["total_lengths"][i], data["response_lengths"][i]
        # Response token j of sample i is predicted at position at + t - r - 1 + j.
        pos = torch.arange(at + t - r - 1, at + t - 1)
        lp_all = logp_all[pos]
        logp = lp_all.gather(-1, tokens[0, pos + 1, None]).squeeze(-1)
        entropy = -(lp_all.exp() * lp_all).sum(-1)
        ratio = torch.exp(logp - data["log_probs"][i])
        a = data["advantages"][i]
        pg = torch.maximum(-ratio * a, -ratio.clamp(1 - EPS_CLIP, 1 + EPS_CLIP_HIGH) * a)
        d = data["ref_log_probs"][i] - logp
        kl = (torch.exp(d) - 1 - d).clamp(-10, 10)
        wi = w[i, :r]
        loss = loss + (wi * (pg - ENTROPY_COEF * entropy + KL_COEF * kl)).sum()
        at += t
    loss.backward()
    model.finish_grad_sync()
    return gather_full_grads(chunks)


def slime_share(case: OracleCase, mode: str) -> float:
    """What slime's default setting weighs against the plugin's: rollouts with a loss token
    over all rollouts (1 for the per-token setting)."""
    if not MODES[mode].divides_by_batch_size:
        return 1.0
    data = slime_rollout(case, 264, mode)
    kept = {r for r, m in zip(data["rollout_ids"], data["loss_masks"], strict=True) if m.any()}
    return len(kept) / data["num_rollouts"]


# ------------------------------------------------------------------------------ the driver


def _columns(layouts: Sequence[MatrixLayout]) -> list[tuple[MatrixLayout, bool]]:
    """Each layout, and CP layouts once more in slime's ``--allgather-cp`` layout."""
    out = []
    for lay in layouts:
        out.append((lay, False))
        if lay.cp > 1:
            out.append((dataclasses.replace(lay, name=lay.name + ALLGATHER), True))
    return out


def run_stack(
    opts: Any,
    options: dict[str, Any],
    *,
    pool: Any,
    progress: IO[str] | None,
    worker: Callable[..., Any] = slime_layout_grads,
) -> AuditReport:
    """Rows ``slime`` and ``slime+lossfix`` (worst mode per layout), one row per mode, and
    ``slime-vs-1rank:<mode>``; ``worker`` runs on every rank (tests bypass the adapter
    through it)."""
    started = time.perf_counter()
    modes = tuple(opts.modes)
    columns = _columns(opts.layouts)
    per_mode = [f"{row}:{m}" for row in ROWS for m in modes]
    options = {**options, "phantom_tokens": phantom_tokens(stack_case(opts, opts.layouts[0]))}
    report = AuditReport(
        options=options,
        modes=[*ROWS, *per_mode, *(f"{SELF_ROW}:{m}" for m in modes)],
        layouts=[
            {**dataclasses.asdict(lay), "world_size": lay.world_size, "allgather_cp": ag}
            for lay, ag in columns
        ],
        baselines=(ROWS[0], *(f"{r}:{m}" for r in (ROWS[0], SELF_ROW) for m in modes)),
    )
    bar = Progress(len(columns), progress)
    refs: dict[tuple, dict[str, torch.Tensor]] = {}
    own: dict[tuple, dict[str, torch.Tensor]] = {}
    one_rank = parse_layout("dp1-m1").parallel()
    for lay, allgather in columns:
        bar.show(lay.name)
        case = stack_case(opts, lay)
        try:
            got = pool.run(
                worker, lay.world_size, lay.parallel(), case, modes, lay.num_microbatches,
                allgather,
            )[0]  # fmt: skip
            worst = dict.fromkeys(ROWS, 0.0)
            for mode in modes:
                key = (repr(case), mode)
                if key not in refs:
                    refs[key] = pool.run(slime_reference, 1, case, mode)[0]
                    own[key] = pool.run(
                        slime_layout_grads, 1, one_rank, case, (mode,), 1, False, ROWS[:1]
                    )[0][(ROWS[0], mode)]
                share = slime_share(case, mode)
                targets = {ROWS[0]: {k: v * share for k, v in refs[key].items()}}
                targets[ROWS[1]] = refs[key]
                for row in ROWS:
                    err = relative_error(got[(row, mode)], targets[row])
                    worst[row] = max(worst[row], err)
                    report.add_result(f"{row}:{mode}", lay, {"error": err}, opts.tolerance)
                err = relative_error(got[(ROWS[0], mode)], own[key])
                report.add_result(f"{SELF_ROW}:{mode}", lay, {"error": err}, opts.tolerance)
            for row, err in worst.items():
                report.add_result(row, lay, {"error": err}, opts.tolerance)
        except Exception as exc:  # noqa: BLE001 - recorded, reported, and fails the run
            report.layout_errors[lay.name] = f"{type(exc).__name__}: {exc}"
            bar.advance(f"{lay.name} FAILED")
            continue
        bar.advance(lay.name)
    report.elapsed_s = time.perf_counter() - started
    return report
