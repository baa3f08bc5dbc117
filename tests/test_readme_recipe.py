"""The own-loop recipe of the README and of docs/own_loop.md, executed as printed.

The ``python`` block that builds the schedule from the flags (the same on both pages) runs on
two data-parallel ranks of a real Megatron-Core GPT, with ``it``, ``model``, ``M``, ``S`` and
``B`` supplied and ``sys.argv`` holding the flags:

* without ``--loss-reduction`` it must be stock Megatron: the same gradient as
  ``get_forward_backward_func()`` with Megatron-LM's loss (sum of masked losses, token count);
* with ``--loss-reduction token_mean --lossfix-self-check`` the self-check runs as part of it
  and prints one line with the measured error, and the gradient is no longer stock's (which
  shows the first comparison can fail);
* the evaluation call the pages describe (``forward_only=True``) reports the same loss as the
  training step on the same data and weights.
"""

from __future__ import annotations

import re

import pytest
from helpers import doc_pages

pytestmark = pytest.mark.oracle


def _recipe() -> str:
    """The recipe block; every page that prints it prints the same code."""
    copies = {
        page.name: body
        for page, _, body in doc_pages.blocks("python")
        if "schedule_from_args(args)" in body
    }
    assert {"README.md", "own_loop.md"} <= set(copies), sorted(copies)
    assert len(set(copies.values())) == 1, "the pages print different recipes"
    return next(iter(copies.values()))


def _relative(a: dict, b: dict) -> float:
    num = sum(float((a[k] - b[k]).double().norm() ** 2) for k in a)
    den = sum(float(b[k].double().norm() ** 2) for k in b)
    return (num / den) ** 0.5


def _run_recipe(code: str, argv: list[str], m: int = 3) -> dict:
    """On each rank: a stock Megatron step, then the recipe, then its evaluation call."""
    import contextlib
    import io
    import sys

    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_lossfix.audit.oracle import OracleCase, make_global_batch, microbatch_plan
    from megatron_lossfix.audit.tiny_gpt import (
        Layout,
        build_tiny_gpt,
        gather_full_grads,
        init_layout,
        set_deterministic_params,
    )

    layout = init_layout(Layout())
    chunks, config = build_tiny_gpt(layout, seq_len=16)
    set_deterministic_params(chunks, 1234)
    case = OracleCase()
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    sizes = microbatch_plan(case, dp, m)[rank]
    batch = make_global_batch(case, config.vocab_size)
    start = rank * sum(sizes)
    parts = {k: torch.split(v[start : start + sum(sizes)], sizes) for k, v in batch.items()}
    mbs = [{k: parts[k][i] for k in parts} for i in range(m)]

    def stock_step(data_iterator, model):
        # Megatron-LM's pretrain_gpt loss: masked sum and token count (the 3-tuple path).
        mb = next(data_iterator)
        out = model(mb["tokens"], mb["position_ids"], None, labels=mb["labels"])
        mask = mb["loss_mask"]
        return out, lambda o: ((o * mask).sum(), mask.sum().int(), {})

    call = dict(model=chunks[0], num_microbatches=m, seq_length=16, micro_batch_size=sizes[0])
    for chunk in chunks:
        chunk.zero_grad_buffer()
    get_forward_backward_func()(
        forward_step_func=stock_step, data_iterator=iter(mbs), forward_only=False, **call
    )
    stock = gather_full_grads(chunks)

    for chunk in chunks:
        chunk.zero_grad_buffer()
    saved_argv = sys.argv
    sys.argv = ["train.py", *argv]
    names = {"it": iter(mbs), "model": chunks[0], "M": m, "S": 16, "B": sizes[0]}
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(code, "recipe", "exec"), names)
    finally:
        sys.argv = saved_argv
    recipe = gather_full_grads(chunks)
    schedule = names["schedule"]
    train_metrics = names["metrics"]
    schedule(
        forward_step_func=names["forward_step"], data_iterator=iter(mbs), forward_only=True, **call
    )
    return {
        "printed": printed.getvalue(),
        "reduction": schedule.config.reduction,
        "stock": stock,
        "recipe": recipe,
        "train_metrics": train_metrics,
        "eval_metrics": schedule.step_metrics(),
    }


def test_recipe_without_the_flag_is_stock_megatron(dist_pool):
    results = dist_pool.run(_run_recipe, 2, _recipe(), [])
    rank0 = results[0]
    assert rank0["reduction"] == "off"
    assert _relative(rank0["recipe"], rank0["stock"]) <= 1e-6
    assert all("self-check" not in r["printed"] for r in results)
    # off is stock: the plugin sees only the reports Megatron returns, and this loss function
    # reports nothing.
    assert rank0["train_metrics"] == rank0["eval_metrics"] == {}


def test_recipe_with_the_flag_normalizes_and_self_checks(dist_pool):
    argv = ["--loss-reduction", "token_mean", "--lossfix-self-check"]
    results = dist_pool.run(_run_recipe, 2, _recipe(), argv)
    rank0 = results[0]
    assert rank0["reduction"] == "token_mean"
    # The plugin's gradient is not stock's on this data (micro-batches hold different numbers
    # of loss tokens): the stock comparison above is not vacuous.
    assert _relative(rank0["recipe"], rank0["stock"]) > 1e-3
    lines = [line for r in results for line in r["printed"].splitlines()]
    passed = [line for line in lines if line.startswith("megatron_lossfix self-check passed")]
    assert len(passed) == 1, lines  # one line for the run, not one per rank
    error = float(re.search(r"changed the gradient by (\S+) ", passed[0])[1])
    assert error <= 1e-5, passed[0]
    train_loss, eval_loss = rank0["train_metrics"]["loss"], rank0["eval_metrics"]["loss"]
    assert eval_loss == pytest.approx(train_loss, rel=1e-6)
