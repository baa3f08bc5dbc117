"""MoE through Megatron-LM's own (patched) ``pretrain_gpt.py``: ``--num-experts 4
--moe-router-topk 2``, expert parallelism 2, and Megatron-LM's load-balancing aux loss.

With ``MEGATRON_LM_ARCHIVES`` naming a folder of Megatron-LM source archives, for the installed
megatron-core's release tag (or the tags of ``MEGATRON_LM_TAGS``), on CPU:

* aux coefficient 0, data where about half the tokens are masked: with ``--loss-reduction
  token_mean`` loss and grad norm under EP2 (2 ranks, 2 micro-batches each) and under micro-batch
  4 on one rank agree with one rank x 8 micro-batches of 1; stock (``off``) they do not.
* aux coefficient 1, data whose loss masks are all zero: the main loss and its gradient are 0,
  so the grad norm is the aux loss's gradient alone. With ``token_mean`` it equals stock
  Megatron's for the same layout at every iteration, as does the logged ``load_balancing_loss``:
  the plugin leaves the aux term as Megatron scales it.

Megatron-LM's default token dispatcher (``allgather``) and its local experts run on CPU: the
``alltoall`` dispatcher hands gloo its split sizes as tensors (a ``TypeError``), grouped GEMM
needs CUDA. Local experts with biases fail in backward (an in-place add on a view, core_v0.16.1),
hence ``--disable-bias-linear``, as MoE models usually are.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.megatron_lm_run import archives_folder, skip_reason, tags_to_test, tiny_gpt_args
from test_examples import max_rel_diff

pytestmark = pytest.mark.e2e

ARCHIVES = archives_folder()
TAGS = tags_to_test(ARCHIVES) if ARCHIVES else []
needs_megatron_lm = pytest.mark.skipif(not TAGS, reason=skip_reason(ARCHIVES))

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear"]
#: layout -> (ranks, micro-batch size, flags); the global batch is 8 sequences.
LAYOUTS = {
    "mb1": (1, 1, []),
    "ep2": (2, 2, ["--expert-model-parallel-size", "2"]),
    "mb4": (1, 4, []),
}
#: The aux coefficient of the aux-loss runs: large enough that its gradient is far from noise.
AUX = 1.0
ITERS = 2
REL = 1e-6


class _MoERuns:
    """Each (checkout, layout, mode, aux) trained once per module, from the same initial
    weights: Megatron-LM initializes experts per EP rank, so an EP2 run would otherwise start
    from other experts than one rank."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.trees: dict[str, tuple[Path, int, str, str, list[str]]] = {}
        self.results: dict[tuple[str, str, str, float], object] = {}

    def tree(self, checkout: str) -> tuple[Path, int, str, str, list[str]]:
        """The patched tree, its EOD id, the masked data, the all-masked data and the flags
        that load the initial weights."""
        if checkout not in self.trees:
            from helpers.megatron_lm_run import (
                prepare_tree,
                save_initial_checkpoint,
                write_padded_dataset,
            )

            root = self.root / checkout
            tree, eod, data = prepare_tree(ARCHIVES, checkout, root)
            # Documents of EOD only: --eod-mask-loss masks every token.
            masked_out = write_padded_dataset(
                root / "data" / "eod", eod=eod, text_len=(0, 1), pad_len=(4, 48)
            )
            args = tiny_gpt_args(micro_batch_size=1, train_iters=1, data_path=data, eod=eod)
            load, _ = save_initial_checkpoint(tree, args + MOE, root / "init")
            self.trees[checkout] = (tree, eod, data, masked_out, load)
        return self.trees[checkout]

    def fetch(self, keys: list[tuple[str, str, str, float]]) -> list:
        """The ``RunResult`` of each (checkout, layout, mode, aux); the missing ones trained
        side by side where the cores allow. ``aux`` > 0 trains on the all-masked data."""
        from helpers.megatron_lm_run import Launch, run_pretrain_gpts

        missing = [key for key in dict.fromkeys(keys) if key not in self.results]
        launches = []
        for checkout, layout, mode, aux in missing:
            tree, eod, data, masked_out, load = self.tree(checkout)
            nproc, mbs, flags = LAYOUTS[layout]
            args = tiny_gpt_args(
                micro_batch_size=mbs,
                train_iters=ITERS,
                data_path=masked_out if aux else data,
                eod=eod,
            )
            args += [*MOE, "--moe-aux-loss-coeff", str(aux), *load, *flags]
            args += ["--loss-reduction", mode]
            metrics = self.root / f"{checkout}-{layout}-{mode}-{aux}.jsonl"
            launches.append(Launch(megatron_lm_path=tree, args=args, nproc=nproc,
                                   metrics_out=metrics))  # fmt: skip
        for key, result in zip(missing, run_pretrain_gpts(launches, timeout=3000), strict=True):
            assert result.returncode == 0, result.output[-4000:]
            iterations = [r["iteration"] for r in result.metrics]
            assert iterations == list(range(1, ITERS + 1)), result.output[-4000:]
            self.results[key] = result
        return [self.results[key] for key in keys]


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory: pytest.TempPathFactory) -> _MoERuns:
    return _MoERuns(tmp_path_factory.mktemp("megatron-lm-moe"))


@needs_megatron_lm
@pytest.mark.parametrize("checkout", TAGS or ["none"])
@pytest.mark.parametrize("layout", ["ep2", "mb4"])
def test_moe_loss_is_layout_invariant(moe_runs: _MoERuns, checkout: str, layout: str,
                                      report_figure):  # fmt: skip
    """Aux coefficient 0: with token_mean, EP2 and micro-batch 4 train the same loss and grad
    norm as one rank x 8 micro-batches; stock Megatron-LM (``off``) does not."""
    keys = [(checkout, run, mode, 0.0) for run in ("mb1", layout) for mode in ("token_mean", "off")]
    ref, stock_ref, fixed, stock = (r.metrics for r in moe_runs.fetch(keys))
    for a, b in zip(ref, fixed, strict=True):
        assert b["num_tokens"] == a["num_tokens"] > 0
        assert b["lm_loss"] == pytest.approx(b["loss"], rel=REL)  # Megatron-LM logs L itself
        assert b["loss"] == pytest.approx(a["loss"], rel=REL)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=REL)
    fix_diff = max(max_rel_diff(ref, fixed, k) for k in ("loss", "grad_norm"))
    assert stock[0]["grad_norm"] != pytest.approx(stock_ref[0]["grad_norm"], rel=1e-2)
    stock_diff = max(max_rel_diff(stock_ref, stock, k) for k in ("loss", "grad_norm"))
    report_figure(f"Megatron-LM {checkout} MoE {layout} aux 0: token_mean max rel diff "
                  f"{fix_diff:.1e}, stock {stock_diff:.1e}")  # fmt: skip


@needs_megatron_lm
@pytest.mark.parametrize("checkout", TAGS or ["none"])
@pytest.mark.parametrize("layout", ["ep2", "mb4"])
def test_moe_aux_loss_is_stock_megatrons(moe_runs: _MoERuns, checkout: str, layout: str,
                                         report_figure):  # fmt: skip
    """Aux coefficient 1 on data whose loss masks are all zero, so that the gradient is the aux
    loss's alone: with token_mean its norm and the logged ``load_balancing_loss`` equal stock
    Megatron-LM's for the same layout at every iteration (a rescaled aux term would change the
    norm by its factor)."""
    from helpers.megatron_lm_run import logged_values

    fixed, stock = moe_runs.fetch([(checkout, layout, m, AUX) for m in ("token_mean", "off")])
    # The plugin ran (it counts the tokens; under off nothing is counted) and saw no loss token.
    assert [r["num_tokens"] for r in fixed.metrics] == [0] * ITERS, fixed.metrics
    assert [r["loss"] for r in fixed.metrics] == [0.0] * ITERS
    for a, b in zip(stock.metrics, fixed.metrics, strict=True):
        assert a["grad_norm"] > 0.1  # the aux loss reaches the gradient
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=REL)
    aux_logged = logged_values(fixed.output, "load_balancing_loss")
    assert sorted(aux_logged) == list(range(1, ITERS + 1)), fixed.output[-4000:]
    assert aux_logged == logged_values(stock.output, "load_balancing_loss")
    diff = max_rel_diff(stock.metrics, fixed.metrics, "grad_norm")
    norms = ", ".join(f"{r['grad_norm']:.6f}" for r in fixed.metrics)
    report_figure(f"Megatron-LM {checkout} MoE {layout} aux {AUX}, all tokens masked: grad norm "
                  f"{norms} (token_mean vs stock max rel diff {diff:.1e}), load_balancing_loss "
                  f"{list(aux_logged.values())}")  # fmt: skip
