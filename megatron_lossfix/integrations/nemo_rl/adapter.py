"""NeMo-RL's Megatron policy worker under the plugin's counts: ``enable()``, no edit of NeMo-RL.

NeMo-RL's losses already return masked sums over global counts, and its ``train.py`` undoes
Megatron's averaging (``x num_microbatches / CP`` with ``calculate_per_token_loss=True``). What
the adapter changes is where a count is not the step's, or not the plugin's:

* **Counts as the plugin's modes define them.** ``process_global_batch`` (the worker's step
  counts, one all-reduce over DP) is wrapped: ``global_valid_toks`` is ``token_mean``'s N (the
  loss tokens ``token_mask[:, 1:] x sample_mask``, as NeMo-RL counts them), and
  ``global_valid_seqs`` is ``sequence_mean``'s S, the sequences with a loss token (NeMo-RL counts
  every sample its ``sample_mask`` keeps, an empty response included). For a preference loss
  (DPO: every pair of rows (chosen, rejected) is one unit, and NeMo-RL divides by
  ``global_valid_seqs / 2``) it is 2 P, P the pairs with a loss token (the plugin's
  ``pair_mean`` unit, counted through its rank-local weights and ``runtime.pairs``).
  The counts ride in one all-reduce over the DP group, after NeMo-RL's own.
* **The VAPO NLL term** (``ClippedPGLossFn`` with ``positive_example_nll_weight > 0`` and
  ``rewards`` in the batch) is normalized by the correct samples' loss tokens of the micro-batch
  NeMo-RL hands the loss (of one sequence under sequence packing): the adapter computes that
  term with ``token_mean`` weights over the step's correct tokens (their global count, in the
  same all-reduce), and the rest of the loss as released. It acts on the loss calls of a step
  it counted (they receive the counts it returned); a loss called on its own runs as released.
* **The split path** (``begin_train_step``, ``train_microbatch`` per chunk,
  ``finish_train_step``) trains with factor 1 and scales the gradients once by 1 / count at
  the end, from counts accumulated over every chunk and reduced once: the adapter accumulates
  the plugin's counts instead (so a step spanning several calls takes the counts of the whole
  step, and one scale). The VAPO NLL term is refused there: its normalizer (the step's correct
  tokens) differs from the one scale's and is known only when the step ends.

Metrics NeMo-RL reports keep their own normalizers; the gradient is the plugin's.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from megatron_lossfix.runtime.losses import loss_weights
from megatron_lossfix.runtime.pairs import pair_weights
from megatron_lossfix.runtime.weights import count_tokens

__all__ = ["disable", "enable", "enabled", "hook_calls", "is_enabled", "step_counts"]

_ORIGINALS: dict[str, Any] = {}
#: The counts of the step ``process_global_batch`` opened last (this process).
_STEP: dict[str, torch.Tensor] = {}
#: How often each of the adapter's hooks acted since :func:`enable`.
_CALLS: collections.Counter = collections.Counter()


def _modules() -> tuple[Any, Any]:
    from nemo_rl.algorithms.loss import loss_functions
    from nemo_rl.models.policy.workers import megatron_policy_worker

    return megatron_policy_worker, loss_functions


def _loss_mask(data: Any) -> torch.Tensor:
    """The loss tokens NeMo-RL counts: ``token_mask[:, 1:] x sample_mask`` (without a token
    mask, every position of a kept sample, as NeMo-RL's count says)."""
    sample = data["sample_mask"].float()
    if "token_mask" in data:
        return data["token_mask"][:, 1:].float() * sample.unsqueeze(-1)
    width = data["input_ids"].shape[1]
    return sample.unsqueeze(-1).expand(-1, width).contiguous()


def _is_preference(loss_fn: Any) -> bool:
    from nemo_rl.algorithms.loss.loss_functions import PreferenceLossFn

    return isinstance(loss_fn, PreferenceLossFn)


def _vapo(loss_fn: Any, data: Any) -> bool:
    return getattr(loss_fn, "positive_example_nll_weight", 0) > 0 and "rewards" in data


def _local_counts(loss_fn: Any, data: Any) -> torch.Tensor:
    """This rank's ``[N, S or 2 P, correct tokens]`` of ``data`` (float64, not reduced)."""
    mask = _loss_mask(data)
    counts = count_tokens([mask], global_counts=False)
    units = counts.num_sequences
    if _is_preference(loss_fn):
        rows = mask.shape[0]
        if rows % 2:
            raise ValueError(
                "a preference batch holds (chosen, rejected) pairs of rows: an odd row count "
                f"({rows}) cannot be paired"
            )
        # The plugin's pair unit: rows (2i, 2i + 1) share id i; a pair counts when it holds a
        # loss token. Local weights (no group): each counted pair weighs 1 / P_local.
        ids = torch.arange(rows, device=mask.device) // 2
        local = loss_weights([mask], "pair_mean", pair_ids=[ids], rank_local=True)[0]
        units = 2 * (pair_weights(local, ids) > 0).sum(dtype=torch.float64)
    correct = torch.zeros((), dtype=torch.float64, device=mask.device)
    if _vapo(loss_fn, data):
        right = (data["rewards"] > 0).to(mask.dtype).unsqueeze(-1)
        correct = (mask * right).sum(dtype=torch.float64)
    return torch.stack([counts.num_tokens, units, correct])


def step_counts() -> dict[str, torch.Tensor]:
    """The plugin's counts of the step the worker opened last: ``tokens`` (N), ``units`` (S,
    or 2 P for a preference loss) and ``correct_tokens`` (VAPO), global over DP."""
    return dict(_STEP)


def hook_calls() -> dict[str, int]:
    """How often each hook ran since :func:`enable`: ``step_counts`` (a step's counts),
    ``pg_loss`` (every ``ClippedPGLossFn`` call, through the hook), ``vapo_term`` (those of a
    counted step with the VAPO term, which the hook computes), ``split_chunk``."""
    return dict(_CALLS)


def _process_global_batch(original: Any, data: Any, loss_fn: Any, dp_group: Any, **kw: Any):
    out = original(data, loss_fn, dp_group, **kw)
    totals = _local_counts(loss_fn, out["batch"]).to(out["global_valid_toks"].device)
    torch.distributed.all_reduce(totals, group=dp_group)
    dtype = out["global_valid_toks"].dtype
    toks, seqs = totals[0].to(dtype), totals[1].to(dtype)
    # The step's loss calls receive these very tensors (NeMo-RL passes them through): the VAPO
    # hook acts on those calls only, never on a loss called outside this step.
    _STEP.update(tokens=toks, units=seqs, correct_tokens=totals[2])
    _CALLS["step_counts"] += 1
    return {**out, "global_valid_toks": toks, "global_valid_seqs": seqs}


def _clipped_pg_call(
    original: Any,
    self: Any,
    next_token_logprobs: torch.Tensor,
    data: Any,
    global_valid_seqs: Any,
    global_valid_toks: Any,
    *args: Any,
    **kw: Any,
) -> tuple[torch.Tensor, dict]:
    _CALLS["pg_loss"] += 1
    if not _vapo(self, data) or global_valid_toks is not _STEP.get("tokens"):
        # Not a loss call of a step the adapter counted (a loss called on its own, or NeMo-RL's
        # other workers): as released.
        return original(self, next_token_logprobs, data, global_valid_seqs, global_valid_toks,
                        *args, **kw)  # fmt: skip
    _CALLS["vapo_term"] += 1
    weight = self.positive_example_nll_weight
    self.positive_example_nll_weight = 0.0
    try:
        loss, metrics = original(self, next_token_logprobs, data, global_valid_seqs,
                                 global_valid_toks, *args, **kw)  # fmt: skip
    finally:
        self.positive_example_nll_weight = weight
    right = (data["rewards"] > 0).to(next_token_logprobs.dtype).unsqueeze(-1)
    correct = _loss_mask(data).to(next_token_logprobs.dtype) * right
    total = _STEP["correct_tokens"].to(next_token_logprobs.device)
    nll = -(next_token_logprobs * correct).sum() / total.clamp(min=1).to(next_token_logprobs.dtype)
    metrics = {**metrics, "positive_nll_loss": nll.detach()}
    return loss + weight * nll, metrics


def _train_microbatch_body(original: Any, self: Any, state: dict, data: Any) -> Any:
    loss_fn = state["loss_fn"]
    if _vapo(loss_fn, data):
        raise ValueError(
            "the split path (train_microbatch) scales the whole step once by 1 / count when it "
            "ends, and the VAPO NLL term needs its own count (the step's correct tokens): train "
            "with positive_example_nll_weight through train(), or set it to 0"
        )
    _CALLS["split_chunk"] += 1
    local = _local_counts(loss_fn, data).to(state["local_valid_toks"].device)
    state["lossfix_counts"] = state.get("lossfix_counts", 0) + local
    return original(self, state, data)


def _finish_train_step_body(original: Any, self: Any, state: dict) -> Any:
    counts = state.get("lossfix_counts")
    if counts is not None:
        state["local_valid_toks"] = counts[0].to(state["local_valid_toks"].dtype)
        state["local_valid_seqs"] = counts[1].to(state["local_valid_seqs"].dtype)
    return original(self, state)


def _patch(owner: Any, name: str, wrapper: Any, method: bool = False) -> None:
    key = f"{owner.__name__}.{name}"
    original = getattr(owner, name)
    _ORIGINALS[key] = (owner, name, original)
    if method:

        @functools.wraps(original)
        def bound(self: Any, *args: Any, **kwargs: Any) -> Any:
            return wrapper(original, self, *args, **kwargs)

        setattr(owner, name, bound)
    else:
        setattr(owner, name, functools.wraps(original)(functools.partial(wrapper, original)))


def is_enabled() -> bool:
    """Whether :func:`enable` is in force."""
    return bool(_ORIGINALS)


def enable() -> None:
    """Run NeMo-RL's Megatron worker under the plugin's counts (module docstring); idempotent.
    Call it in the worker's process before its training step (e.g. where the worker is built)."""
    if _ORIGINALS:
        return
    worker_module, loss_functions = _modules()
    worker = worker_module.MegatronPolicyWorkerImpl
    _patch(worker_module, "process_global_batch", _process_global_batch)
    _patch(loss_functions.ClippedPGLossFn, "__call__", _clipped_pg_call, method=True)
    _patch(worker, "_train_microbatch_body", _train_microbatch_body, method=True)
    _patch(worker, "_finish_train_step_body", _finish_train_step_body, method=True)


def disable() -> None:
    """Undo :func:`enable`: NeMo-RL as released."""
    for owner, name, original in _ORIGINALS.values():
        setattr(owner, name, original)
    _ORIGINALS.clear()
    _STEP.clear()
    _CALLS.clear()


@contextlib.contextmanager
def enabled(on: bool = True) -> Iterator[None]:
    """``enable()`` for the block (nothing when ``on`` is false), undone after it."""
    if not on:
        yield
        return
    enable()
    try:
        yield
    finally:
        disable()
