"""ms-swift's own Megatron trainers under the audit (``--stack ms-swift``) and the adapter.

The e2e tests run ms-swift's ``train_step`` (SFT, DPO and KTO trainers, from the installed
ms-swift: docs/ms_swift.md) on the tiny GPT over two ranks and compare the gradient with the
one-rank reference of each setting's exact objective; they skip where ms-swift is not
installed. Each check is shown to fail with the adapter bypassed, with the plugin's pair
weights replaced by ms-swift's per-micro-batch mean, and with KTO's KL baseline taken per
micro-batch. The unit tests need neither ms-swift nor a process group.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from helpers.inputs import needs_stack

from megatron_lossfix.audit.matrix import parse_layout
from megatron_lossfix.audit.options import AuditOptions
from megatron_lossfix.audit.oracle import relative_error
from megatron_lossfix.audit.stacks.ms_swift import batch, objective, ranks, stack
from megatron_lossfix.integrations.ms_swift import adapter

ROOT = Path(__file__).resolve().parents[1]
HAVE_SWIFT = importlib.util.find_spec("swift") is not None
needs_swift = needs_stack(
    HAVE_SWIFT, "ms-swift", "ms-swift is not installed (docs/ms_swift.md: the [ms-swift] extra)"
)
TOL = 1e-5


# ------------------------------------------------------------------------------ unit


@pytest.mark.unit
def test_packed_micro_batches_hold_different_numbers_of_units():
    assert batch.uneven_sizes(12, 3) == [1, 4, 7]
    assert batch.uneven_sizes(5, 1) == [5]
    case = batch.stack_case(AuditOptions(), parse_layout("dp1-m3"))
    units = batch.step_units(case, 264, "dpo")
    mbs = batch.micro_batches(units, "dpo", True, 0, 1, 3)
    assert [len(mb["seq_lens"]) // 2 for mb in mbs] == batch.uneven_sizes(len(units), 3)
    assert all(mb["input_ids"].shape[0] == 1 for mb in mbs)


@pytest.mark.unit
@pytest.mark.parametrize("packed", [False, True])
def test_the_plugin_reads_one_pair_id_per_sequence(packed):
    case = batch.stack_case(AuditOptions(), parse_layout("dp1-m1"))
    dpo = batch.micro_batches(batch.step_units(case, 264, "dpo"), "dpo", packed, 0, 1, 2)[1]
    mb = adapter.plugin_micro_batch(dpo, "dpo", packed)
    k = mb["num_pairs"]
    assert mb["pair_ids"].tolist() == list(range(k)) * 2
    # Chosen rows first: the chosen mask holds the first half's loss tokens only.
    assert 0 < mb["chosen_mask"].sum() < mb["loss_mask"].sum()
    if packed:
        assert mb["cu_seqlens"].tolist()[-1] == dpo["input_ids"].shape[1]
        assert len(mb["cu_seqlens"]) == 2 * k + 1
    if packed:  # a packed row's trailing padding: a segment of its own, with no loss token
        padded = {**dpo, "position_ids": torch.cat([dpo["position_ids"], torch.arange(4)[None]], 1),
                  "labels": torch.cat([dpo["labels"], torch.full((1, 4), -100)], 1)}  # fmt: skip
        mb = adapter.plugin_micro_batch(padded, "dpo", packed)
        assert mb["pair_ids"].tolist() == [*range(k), *range(k), 2 * k]
    rm = batch.micro_batches(batch.step_units(case, 264, "rm"), "rm", packed, 0, 1, 2)[1]
    mb = adapter.plugin_micro_batch(rm, "rm", packed)
    assert mb["pair_ids"].tolist() == list(range(mb["num_pairs"])) * 2
    # No labels: every token of the reward model's sequences stands in the loss mask.
    if packed:
        assert len(mb["cu_seqlens"]) == 2 * mb["num_pairs"] + 1 and bool(mb["loss_mask"].all())
    else:
        assert torch.equal(mb["loss_mask"], rm["attention_mask"].float())
    kto = batch.micro_batches(batch.step_units(case, 264, "kto"), "kto", packed, 0, 1, 2)[0]
    assert adapter.plugin_micro_batch(kto, "kto", packed)["pair_ids"].tolist() == list(
        range(len(kto["label"]))
    )


@pytest.mark.unit
@pytest.mark.parametrize("loss_type", ["bco_pair", "aot", ["sigmoid", "hinge"]])
def test_loss_types_that_couple_pairs_are_refused_in_one_line(loss_type):
    with pytest.raises(ValueError, match="set loss_type to one of") as err:
        adapter._one_loss_type(loss_type, adapter.DPO_LOSS_TYPES, "DPO pair")
    assert "\n" not in str(err.value)
    assert adapter._one_loss_type(["ipo"], adapter.DPO_LOSS_TYPES, "DPO pair") == "ipo"


@pytest.mark.unit
def test_ci_runs_the_pages_install_line():
    """CI runs docs/ms_swift.md's install line as printed (``noxfile.py``'s ``STACK_PAGES``),
    and the extra pins the release the stack was measured on."""
    from helpers import doc_pages

    stack_name, line = doc_pages.install_line("docs/ms_swift.md")
    assert stack_name == "ms-swift" and '-e ".[ms-swift]"' in line
    assert '"docs/ms_swift.md"' in ROOT.joinpath("noxfile.py").read_text()
    assert f'"ms-swift=={stack.MIN_VERSION}"' in ROOT.joinpath("setup.py").read_text()


@pytest.mark.unit
def test_ci_finds_this_file_from_the_stacks_name():
    """CI runs ``tests/test_<stack>_stack.py`` in the page's virtualenv (and leaves it out of the
    suite's): for ``ms-swift`` that is this file, the hyphen an underscore."""
    import ast

    tree = ast.parse(ROOT.joinpath("noxfile.py").read_text())
    (func,) = [n for n in tree.body if getattr(n, "name", "") == "_stack_test_file"]
    namespace: dict = {}
    exec(compile(ast.Module(body=[func], type_ignores=[]), "noxfile.py", "exec"), namespace)
    path = namespace["_stack_test_file"]("ms-swift")
    assert ROOT.joinpath(path) == Path(__file__).resolve()


# ------------------------------------------------------------------------------ e2e


@pytest.fixture(scope="module")
def swift_pool():
    from megatron_lossfix.audit.pool import DistPool

    pool = DistPool(max_ranks=2, timeout_s=600)
    yield pool
    pool.close()


def _errors(pool, worker, layout: str, settings, rows=ranks.ROWS) -> dict:
    """Each run's error against its setting's exact objective."""
    lay = parse_layout(layout)
    case = batch.stack_case(AuditOptions(), lay)
    got = pool.run(worker, lay.world_size, lay.parallel(), case, lay.num_microbatches, rows,
                   settings)[0]  # fmt: skip
    refs = pool.run(objective.swift_references, 1, case, list(settings))[0]
    return {key: relative_error(grads, refs[key[1]]) for key, grads in got.items()}


@needs_swift
@pytest.mark.e2e
def test_adapter_is_exact_where_ms_swift_is_not(swift_pool):
    settings = ("sft-packed", "dpo-packed", "dpo-rpo", "dpo-hinge", "kto-kl", "rm-packed")
    err = _errors(swift_pool, ranks.swift_layout_grads, "dp2-m3", settings)
    assert err[(ranks.SWIFT_ROW, "sft-packed")] < TOL  # its token mean is exact as released
    assert err[(ranks.SWIFT_ROW, "dpo-packed")] > 0.1  # 1 pair against 5: loss.mean() each
    assert err[(ranks.SWIFT_ROW, "dpo-rpo")] > 1e-2  # the NLL term's per-micro-batch mean
    assert err[(ranks.SWIFT_ROW, "dpo-hinge")] > 0.1  # loss_type not passed: trains sigmoid
    assert err[(ranks.SWIFT_ROW, "kto-kl")] > TOL  # the KL baseline of the micro-batch
    assert err[(ranks.SWIFT_ROW, "rm-packed")] > 0.1  # the reward pairs' mean per micro-batch
    for setting in settings:
        assert err[(ranks.ADAPTED_ROW, setting)] < TOL, (setting, err)


@needs_swift
@pytest.mark.e2e
@pytest.mark.parametrize("layout", ["cp2-m3", "pp2-m4"])
def test_adapter_is_exact_under_context_and_pipeline_parallelism(swift_pool, layout):
    settings = ("dpo-rpo-packed", "dpo-ipo", "kto-kl-packed", "rm")
    err = _errors(swift_pool, ranks.swift_layout_grads, layout, settings, (ranks.ADAPTED_ROW,))
    for setting in settings:
        assert err[(ranks.ADAPTED_ROW, setting)] < TOL, (setting, err)


@needs_swift
@pytest.mark.e2e
@pytest.mark.parametrize(
    "worker, setting",
    [
        ("bypassed_layout_grads", "dpo-packed"),
        ("micro_batch_mean_grads", "dpo-packed"),
        ("micro_batch_mean_grads", "kto-packed"),
        ("bypassed_layout_grads", "rm-packed"),
        ("micro_batch_mean_grads", "rm-packed"),
        ("micro_batch_kl_grads", "kto-kl"),
    ],
)
def test_weakening_the_adapter_fails_the_check(swift_pool, worker, setting):
    from helpers import ms_swift_stack

    fn = getattr(ms_swift_stack, worker)
    err = _errors(swift_pool, fn, "dp2-m3", (setting,), (ranks.ADAPTED_ROW,))
    assert err[(ranks.ADAPTED_ROW, setting)] > TOL, err


@needs_swift
@pytest.mark.e2e
def test_other_trainers_are_refused_in_one_line(swift_pool):
    from helpers.ms_swift_stack import refusal

    message = swift_pool.run(refusal, 1)[0]
    assert "MegatronGRPOTrainer" in message and "disable()" in message and "\n" not in message


@pytest.mark.unit
def test_the_objective_weighs_every_pair_alike():
    """The reference's DPO term is the mean over the step's pairs of the pair's loss."""
    z = torch.tensor([0.5, -1.0])
    assert torch.allclose(objective._dpo_losses(z, "hinge", 0.1), torch.tensor([0.95, 1.1]))
    assert torch.allclose(objective._dpo_losses(z, "ipo", 0.5), (z - 1.0) ** 2)
