"""Resize a running job: Megatron-LM's (patched) ``pretrain_gpt.py`` trains 2 iterations on one
layout, saves a torch_dist checkpoint, and resumes for 2 more on another; its 4-iteration loss
and grad-norm curve is the uninterrupted run's.

With ``MEGATRON_LM_ARCHIVES`` naming a folder of Megatron-LM source archives, for the installed
megatron-core's release tag (or the tags of ``MEGATRON_LM_TAGS``), on CPU, data where about half
the tokens are masked, global batch 8 and seed fixed. The uninterrupted run is one rank x 8
micro-batches of 1 (``--train-iters 4``), saving at iteration 2; the pairs:

* ``mb1-mb4``: its iteration-2 checkpoint resumed with micro-batch 4;
* ``dp2-tp2``: DP2 (micro-batch 2) stopped at iteration 2 (``--exit-interval 2``), resumed TP2;
* ``mb1-pp2``: its iteration-2 checkpoint resumed PP2 (micro-batch 2).

Every run says ``--train-iters 4`` (the learning-rate schedule is computed from it). Megatron-LM
reshards the weights and the optimizer state on load; it ignores the saved RNG state when TP or
PP changes (no dropout here, so nothing draws from it).
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

ITERS = 4
SAVED = 2
REL = 1e-6
#: run -> (ranks, micro-batch size, flags, the run whose iteration-2 checkpoint it loads).
RUNS = {
    "ref": (1, 1, ["--save-interval", str(SAVED)], None),
    "dp2": (2, 2, ["--save-interval", str(SAVED), "--exit-interval", str(SAVED)], None),
    "mb4": (1, 4, [], "ref"),
    "tp2": (2, 2, ["--tensor-model-parallel-size", "2"], "dp2"),
    "pp2": (2, 2, ["--pipeline-model-parallel-size", "2"], "ref"),
}
#: pair -> (the run of iterations 1-2, the run of iterations 3-4).
PAIRS = {"mb1-mb4": ("ref", "mb4"), "dp2-tp2": ("dp2", "tp2"), "mb1-pp2": ("ref", "pp2")}
MODES = ("token_mean", "off")


class _ResizeRuns:
    """Each (checkout, run, mode) trained once per module; a resumed run after the run it
    loads, side by side with the others where the cores allow."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.trees: dict[str, tuple[Path, int, str]] = {}
        self.results: dict[tuple[str, str, str], list[dict]] = {}

    def tree(self, checkout: str) -> tuple[Path, int, str]:
        if checkout not in self.trees:
            from helpers.megatron_lm_run import prepare_tree

            self.trees[checkout] = prepare_tree(ARCHIVES, checkout, self.root / checkout)
        return self.trees[checkout]

    def checkpoint(self, checkout: str, run: str, mode: str) -> Path:
        return self.root / checkout / f"ckpt-{run}-{mode}"

    def fetch(self, keys: list[tuple[str, str, str]]) -> None:
        """Train ``keys`` and the runs they load, in waves: each wave what has its checkpoint."""
        from helpers.megatron_lm_run import run_pretrain_gpts

        wanted = list(dict.fromkeys(keys))
        wanted += [(c, RUNS[r][3], m) for c, r, m in wanted if RUNS[r][3] is not None]
        missing = [key for key in dict.fromkeys(wanted) if key not in self.results]
        while missing:
            wave = [k for k in missing if RUNS[k[1]][3] is None or (k[0], RUNS[k[1]][3], k[2])
                    in self.results]  # fmt: skip
            launches = [self._launch(*key) for key in wave]
            for key, result in zip(wave, run_pretrain_gpts(launches, timeout=3000), strict=True):
                assert result.returncode == 0, result.output[-4000:]
                first = SAVED + 1 if RUNS[key[1]][3] else 1
                last = SAVED if "--exit-interval" in RUNS[key[1]][2] else ITERS
                iterations = [r["iteration"] for r in result.metrics]
                assert iterations == list(range(first, last + 1)), result.output[-4000:]
                self.results[key] = result.metrics
            missing = [key for key in missing if key not in self.results]

    def _launch(self, checkout: str, run: str, mode: str):
        from helpers.megatron_lm_run import Launch

        tree, eod, data = self.tree(checkout)
        nproc, mbs, flags, loads = RUNS[run]
        args = tiny_gpt_args(micro_batch_size=mbs, train_iters=ITERS, data_path=data, eod=eod)
        args += [*flags, "--ckpt-format", "torch_dist", "--loss-reduction", mode]
        if "--save-interval" in flags:
            args += ["--save", str(self.checkpoint(checkout, run, mode))]
        if loads is not None:
            load = self.checkpoint(checkout, loads, mode)
            args += ["--load", str(load), "--ckpt-step", str(SAVED)]
        metrics = self.root / checkout / f"{run}-{mode}.jsonl"
        return Launch(megatron_lm_path=tree, args=args, nproc=nproc, metrics_out=metrics)

    def curve(self, checkout: str, pair: str, mode: str) -> list[dict]:
        """The 4 iterations of ``pair``: its first run's 1-2, then its second run's 3-4."""
        first, second = PAIRS[pair]
        self.fetch([(checkout, run, mode) for run in ("ref", first, second)])
        head = [r for r in self.results[checkout, first, mode] if r["iteration"] <= SAVED]
        return head + self.results[checkout, second, mode]


@pytest.fixture(scope="module")
def resize_runs(tmp_path_factory: pytest.TempPathFactory) -> _ResizeRuns:
    return _ResizeRuns(tmp_path_factory.mktemp("megatron-lm-resize"))


@needs_megatron_lm
@pytest.mark.parametrize("checkout", TAGS or ["none"])
@pytest.mark.parametrize("pair", list(PAIRS))
def test_resumed_on_another_layout_continues_the_loss_curve(
    resize_runs: _ResizeRuns, checkout: str, pair: str, report_figure
):
    """With token_mean the resized run's loss and grad norm equal the uninterrupted run's at all
    4 iterations to 1e-6; stock (``off``) they differ from iteration 3 on (from 1 under DP2)."""
    resize_runs.fetch([(checkout, run, m) for run in ("ref", *PAIRS[pair]) for m in MODES])
    ref = resize_runs.results[checkout, "ref", "token_mean"]
    resized = resize_runs.curve(checkout, pair, "token_mean")
    assert [r["iteration"] for r in resized] == list(range(1, ITERS + 1))
    for a, b in zip(ref, resized, strict=True):
        assert b["num_tokens"] == a["num_tokens"]  # the same data, in the same order
        assert b["loss"] == pytest.approx(a["loss"], rel=REL)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=REL)
    fix_diff = max(max_rel_diff(ref, resized, k) for k in ("loss", "grad_norm"))
    stock_ref = resize_runs.results[checkout, "ref", "off"]
    stock = resize_runs.curve(checkout, pair, "off")
    # After the resize the stock step averages over other micro-batches: far more than 1e-6.
    resumed = slice(SAVED, ITERS)
    stock_diff = max_rel_diff(stock_ref[resumed], stock[resumed], "grad_norm")
    assert stock_diff > 1e-3, (stock_ref, stock)
    stock_diff = max(max_rel_diff(stock_ref, stock, k) for k in ("loss", "grad_norm"))
    report_figure(f"Megatron-LM {checkout} resize {pair}: token_mean max rel diff {fix_diff:.1e}, "
                  f"stock {stock_diff:.1e}")  # fmt: skip
