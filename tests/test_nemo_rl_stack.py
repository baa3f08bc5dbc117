"""NeMo-RL's own Megatron policy worker under the audit (``--stack nemo-rl``), the adapter, and
NeMo-RL's own loss tests with the adapter switched on.

The e2e tests run the worker's ``train()`` and split path from NeMo-RL's source, installed as
docs/nemo_rl.md says (``.venv-nemo-rl``), on the tiny GPT over two ranks and compare the gradient
with the exact objective's, by plain autograd on one rank; they skip where NeMo-RL is not
installed. NeMo-RL's own tests run from its source tree, which ``NEMO_RL_SOURCE`` names (a clone
or its ``git archive`` ``.tar.gz``; CI sets it); they skip without it, and fail under CI
(``helpers.inputs``). The unit tests need neither.
"""

from __future__ import annotations

import importlib.util
import io
import tarfile
from pathlib import Path

import pytest
from helpers import own_tests
from helpers.inputs import needs_stack

from megatron_lossfix.audit.matrix import parse_layout
from megatron_lossfix.audit.oracle import relative_error
from megatron_lossfix.audit.stacks.nemo_rl import stack
from megatron_lossfix.integrations.nemo_rl import install

HAVE_NEMO_RL = importlib.util.find_spec("nemo_rl") is not None
needs_nemo_rl = needs_stack(
    HAVE_NEMO_RL,
    "nemo-rl",
    "nemo_rl is not installed (python -m megatron_lossfix install-nemo-rl, see docs/nemo_rl.md)",
)
TOL = 1e-5
#: NeMo-RL's CPU tests of its loss path (losses, its Megatron train step and data), run
#: unchanged with the adapter switched on.
NEMO_RL_TESTS = (
    "unit/algorithms/test_loss_functions.py",
    "unit/models/megatron/test_train.py",
    "unit/models/megatron/test_megatron_data.py",
)
#: How many of them pass on CPU at NeMo-RL's 7ea279a: 32 + 83 (47 more need a GPU and skip).
NEMO_RL_TESTS_PASSING = 115


# ------------------------------------------------------------------------------ unit


@pytest.mark.unit
def test_every_setting_runs_both_paths_and_the_split_path_refuses_vapo():
    plan = stack.runs(tuple(stack.MODES))
    assert {s for _, _, s in plan} == set(stack.MODES)
    adapted = {(p, s) for r, p, s in plan if r == "nemo-rl+lossfix"}
    assert ("split", "vapo") not in adapted and ("train", "vapo") in adapted
    assert {(p, s) for r, p, s in plan if r == "nemo-rl"} == {
        (p, s) for p in ("train", "split") for s in stack.MODES
    }
    assert stack.row_name("nemo-rl", "split", "dpo") == "nemo-rl:dpo+split"


@pytest.mark.unit
def test_cp_layouts_run_packed_and_one_layout_runs_both_ways():
    cols = stack.columns([parse_layout(n) for n in ("dp1-m3", "dp2-m3", "cp2-m3")])
    assert [(lay.name, packed) for lay, packed in cols] == [
        ("dp1-m3", False),
        ("dp1-m3" + stack.PACKED, True),
        ("dp2-m3", False),
        ("cp2-m3" + stack.PACKED, True),
    ]


@pytest.mark.unit
def test_layouts_cut_whole_dpo_pairs():
    for name in stack.LAYOUTS:
        assert stack._mbs(parse_layout(name)) % 2 == 0, name
    with pytest.raises(ValueError, match="even size"):
        stack._mbs(parse_layout("dp2-m6"))


@pytest.mark.unit
def test_install_reads_the_trees_version_from_a_clone_or_an_archive(tmp_path):
    info = "MAJOR = 0\nMINOR = 20\nPATCH = 0\nPRE_RELEASE = ''\n"
    clone = tmp_path / "Megatron-LM" / "megatron" / "core"
    clone.mkdir(parents=True)
    (clone / "package_info.py").write_text(info)
    tree = install.source_tree(str(tmp_path / "Megatron-LM"), tmp_path, marker="megatron/core")
    assert install.core_version(tree) == "0.20.0"
    archive = tmp_path / "lm.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        data = info.replace("PATCH = 0", "PATCH = 1").encode()
        entry = tarfile.TarInfo("Megatron-LM-x/megatron/core/package_info.py")
        entry.size = len(data)
        tar.addfile(entry, io.BytesIO(data))
    (tmp_path / "out").mkdir()
    tree = install.source_tree(str(archive), tmp_path / "out", marker="megatron/core")
    assert tree.name == "Megatron-LM-x" and install.core_version(tree) == "0.20.1"
    with pytest.raises(SystemExit, match="has no nemo_rl"):
        install.source_tree(str(tmp_path / "Megatron-LM"), tmp_path, marker="nemo_rl")


# ------------------------------------------------------------------------------ e2e


@pytest.fixture(scope="module")
def nemo_rl_pool():
    from megatron_lossfix.audit.pool import DistPool

    pool = DistPool(max_ranks=2, timeout_s=300)
    yield pool
    pool.close()


def _errors(pool, worker, settings: tuple[str, ...], chunks: int, layout: str = "dp2-m3",
            packed: bool = False) -> dict:  # fmt: skip
    """Each ``(row, setting)``'s error on ``layout`` against the exact objective, and the
    released row's against NeMo-RL's own one-rank gradient (``"vs-1rank"``)."""
    from megatron_lossfix.audit.stacks.nemo_rl.objective import nemo_rl_reference

    lay = parse_layout(layout)
    runs = [(row, s) for s in settings for row in ("nemo-rl", "nemo-rl+lossfix")]
    mbs = stack.SPLIT_MBS if chunks else stack._mbs(lay)
    got = pool.run(worker, 2, lay.parallel(), runs, mbs, chunks, packed)[0]
    exact = pool.run(nemo_rl_reference, 1, settings)[0]
    one = parse_layout("dp1-m1").parallel()
    own = pool.run(worker, 1, one, [("nemo-rl", s) for s in settings], stack.ROWS_OF_STEP, 0)[0]
    out = {(row, s): relative_error(g, exact[s]) for (row, s), g in got.items()}
    out.update({("vs-1rank", s): relative_error(got[("nemo-rl", s)], own[("nemo-rl", s)])
                for s in settings})  # fmt: skip
    return out


@needs_nemo_rl
@pytest.mark.e2e
def test_adapter_is_exact_where_nemo_rls_train_is_not(nemo_rl_pool):
    errors = _errors(nemo_rl_pool, stack.nemo_rl_layout_grads, ("vapo", "gspo", "dpo"), 0)
    for setting in ("vapo", "gspo", "dpo"):
        assert errors[("nemo-rl+lossfix", setting)] <= TOL, errors
    # VAPO's NLL term, normalized per micro-batch: off on DP2 x 3, even against its own 1 rank.
    assert errors[("nemo-rl", "vapo")] > 1.0 and errors[("vs-1rank", "vapo")] > 1.0, errors
    # GSPO and DPO count the empty response's sample: 10/11 of the plugin's, on every layout.
    for setting in ("gspo", "dpo"):
        assert abs(errors[("nemo-rl", setting)] - 1 / 11) < 1e-4, errors
        assert errors[("vs-1rank", setting)] <= TOL, errors


@needs_nemo_rl
@pytest.mark.e2e
def test_packed_cp2_vapo_is_exact_through_the_adapter(nemo_rl_pool):
    # NeMo-RL's sequence packing calls the loss once per sequence: VAPO's count is then one
    # sequence's; under CP2 each rank holds a zigzag shard of every packed sequence.
    errors = _errors(nemo_rl_pool, stack.nemo_rl_layout_grads, ("vapo",), 0, "cp2-m3", True)
    assert errors[("nemo-rl+lossfix", "vapo")] <= TOL, errors
    assert errors[("nemo-rl", "vapo")] > 1.0, errors


@needs_nemo_rl
@pytest.mark.e2e
def test_split_path_takes_the_whole_steps_counts(nemo_rl_pool):
    errors = _errors(nemo_rl_pool, stack.nemo_rl_layout_grads, ("pg", "dpo"), stack.SPLIT_CALLS)
    assert errors[("nemo-rl+lossfix", "pg")] <= TOL and errors[("nemo-rl", "pg")] <= TOL, errors
    assert errors[("nemo-rl+lossfix", "dpo")] <= TOL, errors
    assert abs(errors[("nemo-rl", "dpo")] - 1 / 11) < 1e-4, errors


@needs_nemo_rl
@pytest.mark.e2e
def test_bypassing_the_adapter_fails_the_check(nemo_rl_pool):
    from helpers.nemo_rl_stack import bypassed_layout_grads

    errors = _errors(nemo_rl_pool, bypassed_layout_grads, ("vapo", "gspo"), 0)
    assert errors[("nemo-rl+lossfix", "vapo")] > 1.0, errors
    assert errors[("nemo-rl+lossfix", "gspo")] > 0.05, errors


@needs_nemo_rl
@pytest.mark.e2e
def test_split_path_refuses_the_vapo_term_in_one_line():
    from megatron_lossfix.audit.stacks.nemo_rl import batch as nb
    from megatron_lossfix.audit.stacks.nemo_rl.cpu import prepare_nemo_rl_imports
    from megatron_lossfix.integrations.nemo_rl import adapter

    prepare_nemo_rl_imports()
    from nemo_rl.models.policy.workers.megatron_policy_worker import MegatronPolicyWorkerImpl

    worker = MegatronPolicyWorkerImpl.__new__(MegatronPolicyWorkerImpl)
    state = {"loss_fn": nb.loss_fn("vapo")}
    with adapter.enabled(), pytest.raises(ValueError, match="VAPO NLL term"):
        worker._train_microbatch_body(state, nb.step_batch("vapo", 264))
    assert not adapter.is_enabled()


@needs_nemo_rl
@pytest.mark.e2e
def test_nemo_rls_own_loss_tests_pass_with_the_adapter_on(tmp_path):
    tree = own_tests.source_tree(
        "NEMO_RL_SOURCE", "NeMo-RL's source: a clone, or its git archive", tmp_path
    )
    # importlib mode: NeMo-RL's tests/unit/models/megatron is a package named megatron, which
    # would shadow Megatron-Core's namespace package once the plugin has imported it.
    run = own_tests.run_own_tests(tree / "tests", NEMO_RL_TESTS, "helpers.nemo_rl_stack",
                                  options=("--import-mode=importlib",))  # fmt: skip
    run.check(at_least=NEMO_RL_TESTS_PASSING)
    report = run.report
    assert report["still_on"], report
    # Their policy-loss tests call ClippedPGLossFn directly: through the adapter's hook, which
    # leaves a loss called outside a counted step as released.
    assert report["hook_calls"].get("pg_loss", 0) > 0, report


@pytest.mark.unit
def test_own_tests_named_here_exist_in_the_archive_layout():
    assert all(Path(name).suffix == ".py" for name in NEMO_RL_TESTS)
