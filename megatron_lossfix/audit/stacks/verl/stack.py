"""``--stack verl``: verl's own Megatron loss path, as released and through the adapter.

What runs is verl's code, unchanged, from the installed package (``pip install -e .[verl]``):

* ``MegatronEngine.forward_backward_batch``: the global token count (``loss_mask.sum()``
  all-reduced over the data-parallel group, ``.item()``), ``dp_size``, verl's own micro-batching
  (``prepare_micro_batches``), ``num_micro_batch`` and the Megatron schedule call it makes;
* ``MegatronEngineWithLMHead.postprocess_micro_batch_func``: the loss times the micro-batch count
  (or, with ``calculate_per_token_loss``, the 3-tuple ``(loss * R / dp, R_local / cp)``);
* ``core_algos.agg_loss``: the aggregation of each ``loss_agg_mode`` with verl's global batch
  information (``dp_size``, ``batch_num_tokens``, ``global_batch_size``, ``loss_scale_factor``),
  called the way verl's ``ppo_loss`` calls it for each of its terms;
* ``vocab_parallel_log_probs_from_logits`` and ``postprocess_bshd_engine`` (the log-probs and
  their all-gather over the context-parallel group, gradient through the local shard only).

The harness (ours): a minimal engine object holding only the attributes those methods read
(:class:`_Engine`; verl's engine class needs a Hugging Face checkpoint and a GPU to build), its
``forward_step`` (the audit's tiny GPT instead of verl's model forward for a Hugging Face
architecture: it slices each sequence for this context-parallel rank as Megatron does and hands
verl's functions the per-token log-probs), the loss function (the negative log-likelihood of
the audit's labels, aggregated by ``agg_loss``), and the data: the audit's global batch, each DP
rank's contiguous slice as a ``TensorDict``.

The ``verl+lossfix`` rows run the same engine and loss function through
:func:`megatron_lossfix.integrations.verl.adapter.forward_backward_batch`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial
from types import SimpleNamespace
from typing import IO, Any

import torch

from megatron_lossfix.audit.matrix import compute_references, reference_jobs
from megatron_lossfix.audit.oracle import OracleCase, make_global_batch, relative_error
from megatron_lossfix.audit.report import AuditReport, Progress, each_layout
from megatron_lossfix.audit.stacks.modes import StackMode, mode_rows

__all__ = ["DISTRIBUTION", "LAYOUTS", "MODES", "layout_grads", "run_stack"]

DISTRIBUTION = "verl"


def _stack_modes() -> dict[str, StackMode]:
    from megatron_lossfix.integrations.verl.adapter import DIVIDES_BY_BATCH_SIZE, VERL_MODES

    return {
        name: StackMode(
            plugin_mode=mode,
            norm_constant=norm,
            divides_by_batch_size=name in DIVIDES_BY_BATCH_SIZE,
        )
        for name, (mode, norm) in VERL_MODES.items()
    }


#: verl's ``loss_agg_mode`` values with a plugin counterpart (the adapter's mapping). The
#: ``seq-mean-token-sum-norm`` constant is verl's ``loss_scale_factor``, which the audit sets to
#: the case's ``norm_constant``.
MODES: dict[str, StackMode] = _stack_modes()

#: ``--stack verl`` without ``--layouts``: DP, PP, CP, TP and an EP2 MoE layout (the verl page's).
LAYOUTS = ("dp2-m3", "pp2-m4", "cp2-m3", "tp2-m3", "dp2-ep2-m3")

ROW = "verl"
ADAPTED_ROW = "verl+lossfix"


def plugin_case(case: OracleCase, stack_mode: StackMode) -> OracleCase:
    """The oracle case whose plugin reference is ``stack_mode``'s (its ``norm_constant``)."""
    if stack_mode.norm_constant is None:
        return case
    return dataclasses.replace(case, norm_constant=stack_mode.norm_constant)


# ------------------------------------------------------------------------------ the harness


def _nll_loss(
    loss_agg_mode: str, loss_scale_factor: float, model_output: dict, data: Any, dp_group: Any
) -> tuple[torch.Tensor, dict]:
    """The harness's loss function, with verl's signature: the negative log-likelihood of the
    labels, aggregated by verl's ``agg_loss`` with verl's global batch information, as verl's
    ``ppo_loss`` aggregates each of its terms. ``agg_loss`` is looked up on its module at each
    call: the adapter swaps it for the weighted sum."""
    from verl.trainer.ppo import core_algos

    del dp_group  # verl passes it; its loss functions do not use it on this path
    loss_mat = -model_output["log_probs"].to_padded_tensor(0.0)
    loss = core_algos.agg_loss(
        loss_mat=loss_mat,
        loss_mask=data["loss_mask"],
        loss_agg_mode=loss_agg_mode,
        dp_size=data["dp_size"],
        batch_num_tokens=data["batch_num_tokens"],
        global_batch_size=data["global_batch_size"],
        loss_scale_factor=loss_scale_factor,
    )
    return loss, {}


def _engine_class() -> type:
    """A class carrying verl's engine methods, for objects that hold only what they read."""
    from verl.workers.engine.megatron.transformer_impl import (
        MegatronEngine,
        MegatronEngineWithLMHead,
    )

    from megatron_lossfix.integrations.verl.adapter import released_forward_backward_batch

    class _Engine:
        # verl's own even where the adapter is installed in this process.
        forward_backward_batch = released_forward_backward_batch()
        get_data_parallel_group = MegatronEngine.get_data_parallel_group
        get_data_parallel_size = MegatronEngine.get_data_parallel_size
        is_mp_src_rank_with_outputs = MegatronEngine.is_mp_src_rank_with_outputs
        _routed_num_tokens = MegatronEngine._routed_num_tokens
        postprocess_micro_batch_func = MegatronEngineWithLMHead.postprocess_micro_batch_func
        prepare_model_outputs = MegatronEngineWithLMHead.prepare_model_outputs

        def __init__(self, chunks: list, tf_config: Any) -> None:
            from megatron.core import parallel_state as ps

            self.module = chunks
            self.tf_config = tf_config
            self.engine_config = SimpleNamespace(
                context_parallel_size=ps.get_context_parallel_world_size(),
                dynamic_context_parallel=False,
                pad_bshd_to_minibatch_max=False,
                # verl's per-token path requires it; the harness's forward needs no padding.
                use_remove_padding=True,
            )
            self.model_config = SimpleNamespace(mtp=SimpleNamespace(enable=False))

        def forward_step(
            self,
            batch_iter: Any,
            model: Any,
            logits_processor_func: Any,
            postprocess_micro_batch_func: Any,
        ) -> tuple:
            """The harness's model forward in place of verl's Hugging Face one: this CP rank's
            slice of each sequence through the tiny GPT; on the last stage verl's log-probs,
            gathered over CP by verl's ``postprocess_bshd_engine``."""
            del logits_processor_func  # verl's model forward hands it the logits; ours is above
            batch = next(batch_iter)
            return _forward(batch, model), partial(
                postprocess_micro_batch_func, data=batch, local_cp_size=None
            )

    return _Engine


def _forward(batch: Any, model: Any) -> Any:
    from megatron.core import parallel_state as ps
    from verl.models.mcore.util import postprocess_bshd_engine
    from verl.utils.megatron.tensor_parallel import vocab_parallel_log_probs_from_logits

    from megatron_lossfix import slice_batch_for_cp

    inputs = {
        "tokens": batch["input_ids"],
        "labels": batch["labels"],
        "position_ids": batch["position_ids"],
    }
    inputs = slice_batch_for_cp(inputs, ps.get_context_parallel_group())
    output = model(inputs["tokens"], inputs["position_ids"], None)
    unwrapped = model
    while not hasattr(unwrapped, "post_process"):
        unwrapped = unwrapped.module
    if not unwrapped.post_process:
        return output
    log_probs = vocab_parallel_log_probs_from_logits(output, inputs["labels"])
    local = torch.ones(log_probs.shape, dtype=torch.bool, device=log_probs.device)
    return {"log_probs": postprocess_bshd_engine(log_probs, local)}


def _real_tokens(loss_mask: torch.Tensor) -> torch.Tensor:
    """verl's ``attention_mask``: each sequence's real tokens, the prompt and the response (up
    to its last loss token; a one-token prompt where there is no response), then padding. verl
    counts them as the tokens routed to MoE experts (its per-token path's divisor)."""
    pos = torch.arange(loss_mask.shape[-1], device=loss_mask.device)
    last = torch.where(loss_mask.bool(), pos, -1).amax(-1)
    length = torch.where(last >= 0, last + 1, 1)
    return (pos[None, :] < length[:, None]).long()


def _rank_data(case: OracleCase, vocab_size: int, num_microbatches: int) -> Any:
    """This DP rank's slice of the global batch as verl's ``TensorDict``, with the non-tensor
    settings verl's trainer puts there (fixed micro-batch size, global batch size)."""
    from megatron.core import parallel_state as ps
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_rank = case.global_batch_size // dp
    batch = make_global_batch(case, vocab_size)
    local = {k: v[rank * per_rank : (rank + 1) * per_rank] for k, v in batch.items()}
    data = TensorDict(
        {
            "input_ids": local["tokens"],
            "labels": local["labels"],
            "position_ids": local["position_ids"],
            "loss_mask": local["loss_mask"],
            "attention_mask": _real_tokens(local["loss_mask"]),
        },
        batch_size=[per_rank],
    )
    tu.assign_non_tensor(
        data,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=per_rank // num_microbatches,
        # verl's trainer sets it to ppo_mini_batch_size: all sequences of the step.
        global_batch_size=case.global_batch_size,
    )
    return data


def layout_grads(
    layout: Any,
    case: OracleCase,
    modes: Sequence[str],
    num_microbatches: int,
    *,
    adapter: bool = True,
) -> dict[str, Any] | None:
    """On every rank: one step per (row, verl mode) under ``layout``; on global rank 0
    ``{(row, mode): full gradient}`` (None elsewhere). ``adapter=False`` runs the adapted row
    through verl's released path too (the check that the audit sees a bypassed adapter)."""
    from megatron_lossfix.audit import tiny_gpt
    from megatron_lossfix.integrations.verl import adapter as lossfix

    tiny_gpt.init_layout(layout)
    pipeline: dict[str, Any] = {}
    if layout.pp > 1:
        # As verl's TransformerConfig: the stages exchange shapes (verl passes seq_length=1).
        # Megatron refuses it with the allgather MoE dispatcher, its default even for a dense
        # model, and gloo cannot run the alltoall one: pipelines here are dense.
        pipeline = {"variable_seq_lengths": True, "moe_token_dispatcher_type": "alltoall"}
    chunks, config = tiny_gpt.build_tiny_gpt(
        layout,
        seq_len=case.seq_length,
        calculate_per_token_loss=case.per_token,
        **pipeline,
        **case.model_kwargs,
    )
    engine = _engine_class()(chunks, config)
    out: dict[tuple[str, str], Any] = {}
    for mode in modes:
        loss_function = partial(_nll_loss, mode, case.norm_constant)
        for row in (ROW, ADAPTED_ROW):
            tiny_gpt.set_deterministic_params(chunks, case.seed)
            for chunk in chunks:
                chunk.zero_grad_buffer()
            data = _rank_data(case, config.vocab_size, num_microbatches)
            if row == ROW or not adapter:
                engine.forward_backward_batch(data, loss_function)
            else:
                fix = lossfix.lossfix_config(mode, loss_scale_factor=case.norm_constant)
                lossfix.forward_backward_batch(engine, data, loss_function, reduction=fix)
            out[row, mode] = tiny_gpt.gather_full_grads(chunks)
    return out if torch.distributed.get_rank() == 0 else None


# ------------------------------------------------------------------------------ the run


def _nonempty_fraction(case: OracleCase) -> float:
    """Sequences with loss tokens / all sequences of the step (verl's seq-mean divides by all)."""
    from megatron_lossfix.audit.tiny_gpt import TinyGPT

    mask = make_global_batch(case, TinyGPT().vocab)["loss_mask"]
    return float((mask.sum(-1) > 0).sum()) / mask.shape[0]


def run_stack(
    opts: Any,
    options: dict[str, Any],
    *,
    pool: Any,
    progress: IO[str] | None,
    worker: Callable[..., Any] = layout_grads,
) -> AuditReport:
    """Rows ``verl`` and ``verl+lossfix`` (worst mode per layout) and one row per mode where
    there are several (:func:`~megatron_lossfix.audit.stacks.modes.mode_rows`); ``worker`` runs on
    every rank (:func:`layout_grads`; tests bypass the adapter through it)."""
    import time

    started = time.perf_counter()
    modes = opts.modes
    per_mode = mode_rows((ROW, ADAPTED_ROW), modes)
    report = AuditReport(
        options=options,
        modes=[ROW, ADAPTED_ROW, *per_mode.values()],
        layouts=[{**dataclasses.asdict(lay), "world_size": lay.world_size} for lay in opts.layouts],
        baselines=(ROW, *(f"{ROW}:{m}" for m in modes)),
    )
    jobs: dict = {}
    for lay in opts.layouts:
        case = opts.case(lay)
        for m in modes:
            mcase = plugin_case(case, MODES[m])
            placement = (lay, mcase, lay.plan(mcase))
            jobs.update(reference_jobs([MODES[m].plugin_mode], [placement]))
    bar = Progress(len(jobs) + len(opts.layouts), progress)
    refs = compute_references(pool, jobs, on_job=bar.reference)

    def measure(lay: Any) -> None:
        case = opts.case(lay)
        grads = pool.run(
            worker, lay.world_size, lay.parallel(), case, tuple(modes), lay.num_microbatches
        )[0]
        fraction = _nonempty_fraction(case)
        worst: dict[str, float] = {ROW: 0.0, ADAPTED_ROW: 0.0}
        for m in modes:
            stack_mode = MODES[m]
            mcase = plugin_case(case, stack_mode)
            ref = _reference(refs, mcase, stack_mode.plugin_mode, lay.plan(mcase))["grads"]
            verl_ref = ref
            if stack_mode.divides_by_batch_size:
                verl_ref = {k: v * fraction for k, v in ref.items()}
            for row, target in ((ROW, verl_ref), (ADAPTED_ROW, ref)):
                err = relative_error(grads[row, m], target)
                worst[row] = max(worst[row], err)
                if (row, m) in per_mode:
                    report.add_result(per_mode[row, m], lay, {"error": err}, opts.tolerance)
        for row, err in worst.items():
            report.add_result(row, lay, {"error": err}, opts.tolerance)

    each_layout(report, bar, [(lay,) for lay in opts.layouts], measure)
    report.elapsed_s = time.perf_counter() - started
    return report


def _reference(refs: dict, case: OracleCase, mode: str, plan: Any) -> dict:
    from megatron_lossfix.audit.matrix import reference_key

    return refs[reference_key(case, mode, plan)]
