"""The plugin inside Megatron Bridge's own training loop (``examples/bridge_pretrain.py``).

Each layout is a launch of Bridge's ``pretrain()`` on CPU/gloo (one with torchrun, the others with
their ranks forked from a process that imported Bridge once: ``helpers.launch``): a tiny GPT,
byte-level records whose loss masks vary between sequences, 2 iterations. With the plugin, 1 rank
and 2 ranks (DP2 with more micro-batches, TP2, PP2) agree on the loss and grad norm to 1e-6; stock
Bridge (``--loss-reduction off``) does not; Bridge's logged ``lm loss`` is the step's loss L.

Bridge's own LoRA (``ConfigContainer.peft``, from a base model a first run saves) and MoE (EP2 and
a DP/micro-batch split; with the aux loss on, stock Megatron's aux gradient) run the same way.

Skipped where megatron-bridge is not installed (``python -m megatron_lossfix install-bridge``
installs it). The packed-batch boundary tests need no Bridge and always run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.launch import Launch, launch_side_by_side

from megatron_lossfix.integrations.bridge.adapter import bridge_cu_seqlens

ROOT = Path(__file__).resolve().parents[1]
HAVE_BRIDGE = importlib.util.find_spec("megatron.bridge") is not None
needs_bridge = pytest.mark.skipif(
    not HAVE_BRIDGE,
    reason="megatron-bridge is not installed (python -m megatron_lossfix install-bridge)",
)

#: A tiny model and 8 sequences per step: 4 micro-batches on one rank.
COMMON = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "64", "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-2",
]  # fmt: skip
#: name -> (processes, flags); every layout runs several micro-batches per rank.
LAYOUTS = {
    "1rank": (1, ["--micro-batch-size", "2"]),
    "dp2": (2, ["--micro-batch-size", "1"]),
    "tp2": (2, ["--micro-batch-size", "2", "--tensor-model-parallel-size", "2"]),
    "pp2": (2, ["--micro-batch-size", "2", "--pipeline-model-parallel-size", "2"]),
}
#: Bridge's own LoRA (rank 4 on every linear layer, base frozen) from a saved base model: the
#: same layouts. ``{base}`` is the checkpoint the ``lora-base`` run writes.
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--pretrained-checkpoint", "{base}"]
LAYOUTS.update({f"lora-{k}": (n, [*flags, *LORA]) for k, (n, flags) in list(LAYOUTS.items())})
#: The same LoRA without a saved model: the example applies it to its seeded base itself.
SEEDED_LORA = ["--lora-rank", "4", "--lora-alpha", "8"]
LAYOUTS.update({f"seeded-lora-{k}": (LAYOUTS[k][0], [*LAYOUTS[k][1], *SEEDED_LORA])
                for k in ("1rank", "dp2")})  # fmt: skip
#: One iteration of plain training, one micro-batch, saved: the model LoRA fine-tunes.
BASE = (1, ["--micro-batch-size", "8", "--train-iters", "1", "--save", "{base}"])
#: MoE (4 experts, top-2, allgather dispatcher). EP2 runs 4 micro-batches of 1 on each of 2
#: ranks, dp2-m4 one micro-batch of 4 on each (the experts whole on every rank).
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]
AUX = ["--moe-aux-loss-coeff", "0.01"]
EP2 = ["--micro-batch-size", "1", "--expert-model-parallel-size", "2"]
LAYOUTS.update(
    {
        "moe-1rank": (1, ["--micro-batch-size", "2", *MOE]),
        "moe-ep2": (2, [*EP2, *MOE]),
        "moe-dp2-m4": (2, ["--micro-batch-size", "4", *MOE]),
        "moe-aux-ep2": (2, [*EP2, *MOE, *AUX]),
        "moe-aux-dp2-m4": (2, ["--micro-batch-size", "4", *MOE, *AUX]),
    }
)
#: (layout, reduction) runs checked against 1 rank. sequence_mean counts sequences over DP and
#: on the last pipeline stage, so it runs on DP2 and PP2; under TP2 every rank sees the same
#: sequences (the gradient oracle covers TP x sequence_mean), so TP2 runs token_mean only.
CHECKED = [
    ("dp2", "token_mean"),
    ("tp2", "token_mean"),
    ("pp2", "token_mean"),
    ("dp2", "sequence_mean"),
    ("pp2", "sequence_mean"),
]
#: LoRA runs every layout in both modes: the issue's table has TP2 x sequence_mean too.
LORA_CHECKED = [*CHECKED, ("tp2", "sequence_mean")]
#: The run launched with torchrun itself, as users launch it; the others fork their ranks from
#: a process that imported Bridge once (``helpers.launch``, ``PRELOAD``).
TORCHRUN = ("dp2", "token_mean")
#: What the example imports, in its order: the CPU mode first, then Bridge's training loop.
PRELOAD = (
    "megatron_lossfix.integrations.bridge.cpu:enable_cpu_bridge",
    "megatron.bridge.training.pretrain",
    "megatron.bridge.training.config",
    "megatron.bridge.models",
    "megatron.bridge.peft.lora",
    "megatron_lossfix.integrations.bridge.adapter",
)
RTOL = 1e-6
_LM_LOSS = re.compile(r"lm loss: ([0-9.E+-]+)")


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def _assert_agree(ref: list[dict], got: list[dict]) -> tuple[float, float]:
    """Each iteration of ``got`` has ``ref``'s token count (> 0), loss and grad norm to
    ``RTOL``; the largest relative differences of loss and of grad norm."""
    for r, g in zip(ref, got, strict=True):
        assert g["num_tokens"] == r["num_tokens"] > 0
        assert _rel(g["loss"], r["loss"]) <= RTOL, (r, g)
        assert _rel(g["grad_norm"], r["grad_norm"]) <= RTOL, (r, g)
    pairs = list(zip(ref, got, strict=True))
    return tuple(max(_rel(g[k], r[k]) for r, g in pairs) for k in ("loss", "grad_norm"))


def _norms(records: list[dict]) -> str:
    """The grad norms of a run's iterations, as the docs quote them."""
    return ", ".join(f"{r['grad_norm']:.4f}" for r in records)


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


_RUNS: dict[tuple[str, str], tuple[list[dict], str]] = {}
#: Each rank prints its line; two ranks' prints may interleave (the text, then its newline).
_LORA_GRADS = re.compile(r"lora grads: rank (\d+): adapters (\d+), base (\[[^]]*\])")


def _run(layout: str, reduction: str, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """(metrics records, output) of one launch of the example; cached per session."""
    return _runs(tmp_path_factory, (layout, reduction))[0]


def _runs(tmp_path_factory: pytest.TempPathFactory, *keys: tuple[str, str]) -> list[tuple]:
    """:func:`_run` of each ``(layout, reduction)``; those not run yet start side by side where
    the cores allow (a one-rank run beside a two-rank one)."""
    missing = [key for key in dict.fromkeys(keys) if key not in _RUNS]
    if any(layout.startswith("lora-") for layout, _ in missing):
        base = _lora_base(tmp_path_factory)
    launches, outs = [], []
    for layout, reduction in missing:
        nproc, flags = LAYOUTS[layout]
        if layout.startswith("lora-"):
            flags = [flag.format(base=base) for flag in flags]
        out = tmp_path_factory.mktemp(f"bridge_{layout}_{reduction}")
        torchrun = (layout, reduction) == TORCHRUN
        launches.append(_launch(nproc, [*flags, "--loss-reduction", reduction], out, torchrun))
        outs.append(out)
    done = launch_side_by_side(launches, timeout=1800)
    for (layout, reduction), out, result in zip(missing, outs, done, strict=True):
        if result.returncode != 0:
            pytest.fail(f"{layout}/{reduction} failed:\n{result.output[-8000:]}")
        records = _records(out)
        assert [r["iteration"] for r in records] == [1, 2], records
        _RUNS[layout, reduction] = (records, result.output)
    return [_RUNS[key] for key in keys]


def _launch(nproc: int, flags: list[str], out: Path, torchrun: bool = False) -> Launch:
    args = [*COMMON, *flags, "--metrics-out", str(out / "metrics.jsonl")]
    return Launch(script=ROOT / "examples" / "bridge_pretrain.py", args=args, nproc=nproc,
                  cwd=out, env=_env(), preload=PRELOAD, torchrun=torchrun)  # fmt: skip


def _records(out: Path) -> list[dict]:
    metrics = out / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


_BASE: list[Path] = []


def _lora_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of plain training (Bridge's PEFT starts from a saved model); once."""
    if not _BASE:
        out = tmp_path_factory.mktemp("bridge_lora_base")
        nproc, flags = BASE
        base = out / "base"
        launch = _launch(nproc, [flag.format(base=base) for flag in flags], out)
        (result,) = launch_side_by_side([launch], timeout=1800)
        if result.returncode != 0:
            pytest.fail(f"saving the LoRA base failed:\n{result.output[-8000:]}")
        _BASE.append(base)
    return _BASE[0]


@pytest.mark.e2e
@needs_bridge
@pytest.mark.parametrize("layout, reduction", CHECKED)
def test_bridge_layouts_agree(layout, reduction, tmp_path_factory, report_figure):
    """Same loss, grad norm and token count on 2 ranks as on 1, at both iterations (the second
    after an optimizer step taken from the first step's gradient)."""
    (ref, _), (got, _) = _runs(tmp_path_factory, ("1rank", reduction), (layout, reduction))
    loss, norm = _assert_agree(ref, got)
    for r, g in zip(ref, got, strict=True):
        assert g["num_sequences"] == r["num_sequences"]
    report_figure(
        f"Bridge {layout} {reduction}: max rel diff loss {loss:.1e}, grad norm {norm:.1e}"
    )


@pytest.mark.e2e
@needs_bridge
def test_stock_bridge_differs(tmp_path_factory, report_figure):
    """Without the plugin, Bridge's gradient depends on how the step is cut into micro-batches:
    the same check that passes above fails (the test can fail), and stock differs from L."""
    (ref, _), (got, _) = _runs(tmp_path_factory, ("1rank", "off"), ("dp2", "off"))
    report_figure(f"stock Bridge, grad norm DP2 vs 1 rank: {_norms(got)} vs {_norms(ref)}")
    assert _rel(got[0]["grad_norm"], ref[0]["grad_norm"]) > 1e-3, (ref[0], got[0])
    exact, _ = _run("1rank", "token_mean", tmp_path_factory)
    assert _rel(exact[0]["grad_norm"], ref[0]["grad_norm"]) > 1e-3
    # off is stock Bridge: the plugin sees nothing of the step, and the record's loss is the
    # one Bridge logs (its token mean), without counts.
    for record in (*ref, *got):
        assert record["loss"] == record["lm_loss"] is not None and record["num_tokens"] is None


@pytest.mark.e2e
@needs_bridge
@pytest.mark.parametrize(
    "layout, reduction", [("1rank", "token_mean"), ("1rank", "sequence_mean"), *CHECKED]
)
def test_logged_lm_loss_is_L(layout, reduction, tmp_path_factory):
    """Bridge's own ``lm loss`` (its loss dict, and its printed log line) is the step's L."""
    records, log = _run(layout, reduction, tmp_path_factory)
    for record in records:
        assert _rel(record["lm_loss"], record["loss"]) <= RTOL, record
    printed = [float(v) for v in _LM_LOSS.findall(log)]
    assert len(printed) == len(records), log[-3000:]
    for value, record in zip(printed, records, strict=True):
        # Printed with 7 significant digits: off by at most 5e-7 relative.
        assert _rel(value, record["loss"]) <= RTOL, (value, record)


@pytest.mark.e2e
@needs_bridge
@pytest.mark.parametrize(
    "layout, reduction", [("dp2", "token_mean"), ("pp2", "sequence_mean"), ("dp2", "off")]
)
def test_bridges_own_loop_runs_the_default_first_step_check(layout, reduction, tmp_path_factory):
    """Bridge's own training loop, launched with the default flags, checks its first step: one
    line from rank 0, that it passed and how the step was re-run (micro-batch 1 under DP2: the
    halves of the loss tokens; PP2 at micro-batch 2: each micro-batch cut in two); no line
    says the check stayed out. ``off`` is stock Bridge: no check."""
    _, log = _run(layout, reduction, tmp_path_factory)
    said = [line for line in log.splitlines() if "megatron_lossfix self-check" in line]
    if reduction == "off":
        assert said == [], said
        return
    assert len(said) == 1 and "megatron_lossfix self-check passed" in said[0], said
    how = "halves of the loss tokens" if layout == "dp2" else "each micro-batch cut in 2"
    assert how in said[0], said


# ---------------------------------------------------------------------------------- LoRA
@pytest.mark.e2e
@needs_bridge
@pytest.mark.parametrize("layout, reduction", LORA_CHECKED)
def test_bridge_lora_layouts_agree(layout, reduction, tmp_path_factory, report_figure):
    """Bridge's own LoRA (``ConfigContainer.peft``) from a saved base: the same loss and adapter
    grad norm on 2 ranks as on 1, and only adapters get a gradient (the base is frozen)."""
    (ref, _), (got, log) = _runs(
        tmp_path_factory, ("lora-1rank", reduction), (f"lora-{layout}", reduction)
    )
    loss, norm = _assert_agree(ref, got)
    _assert_only_adapters_have_grads(log, nproc=LAYOUTS[f"lora-{layout}"][0])
    report_figure(f"Bridge LoRA {layout} {reduction}: max rel diff loss {loss:.1e}, "
                  f"grad norm {norm:.1e}")  # fmt: skip


def _assert_only_adapters_have_grads(log: str, nproc: int) -> None:
    """Every rank reports nonzero gradients on its adapters and none on the base weights."""
    reports = _LORA_GRADS.findall(log)
    assert sorted(int(rank) for rank, _, _ in reports) == list(range(nproc)), log[-3000:]
    for rank, adapters, base in reports:
        assert int(adapters) > 0 and json.loads(base) == [], (rank, adapters, base)


@pytest.mark.e2e
@needs_bridge
def test_bridge_lora_on_the_seeded_base(tmp_path_factory, report_figure):
    """``--lora-rank`` without ``--pretrained-checkpoint``: Bridge's LoRA on the example's seeded
    base agrees between 1 rank and DP2 (more micro-batches), gives only adapters a gradient, and
    stock Bridge's does not agree."""
    runs = _runs(tmp_path_factory, *((f"seeded-lora-{k}", mode) for mode in ("token_mean", "off")
                                     for k in ("1rank", "dp2")))  # fmt: skip
    (ref, _), (got, log), (stock_ref, _), (stock, _) = runs
    loss, norm = _assert_agree(ref, got)
    _assert_only_adapters_have_grads(log, nproc=2)
    assert _rel(stock[0]["grad_norm"], stock_ref[0]["grad_norm"]) > 1e-3, (stock_ref, stock)
    report_figure(f"Bridge LoRA on the seeded base, DP2: max rel diff loss {loss:.1e}, grad norm "
                  f"{norm:.1e}; stock grad norm {stock[0]['grad_norm']:.4f} vs "
                  f"{stock_ref[0]['grad_norm']:.4f}")  # fmt: skip


@pytest.mark.e2e
@needs_bridge
def test_bridge_lora_stock_differs(tmp_path_factory, report_figure):
    """Stock Bridge's LoRA gradient changes with the micro-batch split; the plugin's does not."""
    (ref, log), (got, _) = _runs(tmp_path_factory, ("lora-1rank", "off"), ("lora-dp2", "off"))
    report_figure(f"stock Bridge LoRA, grad norm DP2 vs 1 rank: {_norms(got)} vs {_norms(ref)}")
    assert _rel(got[0]["grad_norm"], ref[0]["grad_norm"]) > 1e-3, (ref[0], got[0])
    exact, _ = _run("lora-1rank", "token_mean", tmp_path_factory)
    assert _rel(exact[0]["grad_norm"], ref[0]["grad_norm"]) > 1e-3
    _assert_only_adapters_have_grads(log, nproc=1)


# ---------------------------------------------------------------------------------- MoE
@pytest.mark.e2e
@needs_bridge
@pytest.mark.parametrize("layout", ["moe-ep2", "moe-dp2-m4"])
def test_bridge_moe_layouts_agree(layout, tmp_path_factory, report_figure):
    """MoE, aux-loss coefficient 0: EP2 and a DP/micro-batch split agree with 1 rank (loss and
    the grad norm over every expert), where stock Bridge does not."""
    (ref, _), (got, _) = _runs(
        tmp_path_factory, ("moe-1rank", "token_mean"), (layout, "token_mean")
    )
    loss, norm = _assert_agree(ref, got)
    report_figure(f"Bridge MoE {layout}: max rel diff loss {loss:.1e}, grad norm {norm:.1e}")


@pytest.mark.e2e
@needs_bridge
def test_the_plugins_own_loop_and_audit_run_beside_bridge(tmp_path):
    """The environment ``install-bridge`` leaves keeps a plain ``import megatron.core`` working
    (nvidia-resiliency-ext 0.4.x, which Bridge used to bring, failed megatron-core 0.19's check
    of it): the own-loop example and the audit run there without the Bridge CPU shims."""
    env = _env()

    def run(*argv: str) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, *argv], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=900)  # fmt: skip
        assert proc.returncode == 0, f"{argv}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        return proc

    run("-c", "import megatron.core")
    own = run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
              str(ROOT / "examples" / "own_loop.py"), "--train-iters", "1")  # fmt: skip
    assert [json.loads(x)["iteration"] for x in own.stdout.splitlines() if x.startswith("{")] == [1]
    run("-m", "megatron_lossfix", "audit", "--layouts", "dp2-m3", "--modes", "token_mean",
        "--no-plot", "--no-progress", "--out", str(tmp_path / "audit"))  # fmt: skip
    assert json.loads((tmp_path / "audit" / "audit.json").read_text())["passed"] is True


@pytest.mark.e2e
@needs_bridge
def test_bridge_moe_stock_differs(tmp_path_factory, report_figure):
    (ref, _), (got, _) = _runs(tmp_path_factory, ("moe-1rank", "off"), ("moe-ep2", "off"))
    report_figure(f"stock Bridge MoE, grad norm EP2 vs 1 rank: {_norms(got)} vs {_norms(ref)}")
    assert _rel(got[0]["grad_norm"], ref[0]["grad_norm"]) > 1e-3, (ref[0], got[0])


_AUX_LOSS = re.compile(r"load_balancing_loss: ([0-9.E+-]+)")


@pytest.mark.e2e
@needs_bridge
@pytest.mark.parametrize("layout", ["moe-aux-ep2", "moe-aux-dp2-m4"])
def test_bridge_moe_aux_loss_is_stock(layout, tmp_path_factory, report_figure):
    """With the aux-loss coefficient above 0 the load-balancing term is stock Megatron's, for
    the same layout (EP2, 4 micro-batches of 1 a rank; DP2, one micro-batch of 4 a rank).
    token_mean_legacy reproduces stock's main loss exactly, so its full gradient equals
    stock's only if the aux gradient is stock's too; the logged load_balancing_loss is
    stock's."""
    (plugin, plugin_log), (stock, stock_log) = _runs(
        tmp_path_factory, (layout, "token_mean_legacy"), (layout, "off")
    )
    for p, s in zip(plugin, stock, strict=True):
        assert _rel(p["grad_norm"], s["grad_norm"]) <= RTOL, (p, s)
    aux = [_AUX_LOSS.findall(log) for log in (plugin_log, stock_log)]
    assert len(aux[0]) == 2 and float(aux[0][0]) > 0, plugin_log[-3000:]
    assert aux[0] == aux[1]
    norms = [", ".join(f"{r['grad_norm']:.7f}" for r in run) for run in (plugin, stock)]
    report_figure(f"Bridge MoE {layout} aux 0.01: grad norm {norms[0]} (stock {norms[1]}), "
                  f"load_balancing_loss {aux[0]}")  # fmt: skip


@pytest.mark.e2e
@needs_bridge
def test_enable_disable_bridge_is_idempotent_and_reversible():
    """enable_bridge twice, then disable_bridge, leaves Bridge's own functions in place."""
    script = """
from megatron_lossfix.integrations.bridge.cpu import enable_cpu_bridge
enable_cpu_bridge()
from megatron.bridge.training import train
from megatron_lossfix import LossFixConfig
from megatron_lossfix.integrations.bridge.adapter import disable_bridge, enable_bridge
getter, step = train.get_forward_backward_func, train.train_step
enable_bridge(LossFixConfig(reduction="token_mean"), metrics_out="/dev/null")
patched = train.get_forward_backward_func
assert patched is not getter and train.train_step is not step
enable_bridge({"reduction": "sequence_mean"})  # a mapping, as from config overrides
assert train.get_forward_backward_func.__wrapped__ is getter
assert train.train_step is step  # no metrics_out: Bridge's own train_step
wrapper = train.get_forward_backward_func(pp_size=1, vp_size=None)
assert wrapper.user_config.reduction == "sequence_mean", wrapper.user_config
disable_bridge()
disable_bridge()
assert train.get_forward_backward_func is getter and train.train_step is step
print("OK")
"""
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", script],
        env=_env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-4000:]


# ---------------------------------------------------------------------------------- packed batches
@pytest.mark.unit
def test_bridge_cu_seqlens_formats():
    """Bridge's packed (THD) boundaries, [1, n] with sentinels, become plain 1-D boundaries."""
    legacy = {"cu_seqlens": torch.tensor([[0, 3, 7, 10, -1, -1]])}
    assert bridge_cu_seqlens(legacy).tolist() == [0, 3, 7, 10]
    with_argmin = {**legacy, "cu_seqlens_argmin": torch.tensor([4])}
    assert bridge_cu_seqlens(with_argmin).tolist() == [0, 3, 7, 10]
    current = {
        "cu_seqlens_q": torch.tensor([[0, 2, 5]]),
        "cu_seqlens_q_padded": torch.tensor([[0, 4, 8]]),
    }
    assert bridge_cu_seqlens(current).tolist() == [0, 4, 8]  # token positions follow padding
    assert bridge_cu_seqlens({"tokens": torch.zeros(1, 4)}) is None
    with pytest.raises(ValueError, match="micro-batch size 1"):
        bridge_cu_seqlens({"cu_seqlens": torch.tensor([[0, 2], [0, 2]])})


@pytest.mark.unit
def test_packed_bridge_batch_counts_each_sequence():
    """sequence_mean over a packed Bridge row weighs each packed sequence like its own row."""
    from megatron_lossfix.runtime.weights import count_tokens, segment_ids, weights_from_counts

    mask = torch.tensor([[0, 1, 1, 1, 0, 0, 1, 1, 0, 0]], dtype=torch.float32)
    packed = {"loss_mask": mask, "cu_seqlens": torch.tensor([[0, 4, 8, 10, -1]])}
    cu_seqlens = bridge_cu_seqlens(packed)
    assert cu_seqlens.tolist() == [0, 4, 8, 10]
    segments, num = segment_ids(cu_seqlens, mask.shape[1])
    counts = count_tokens([mask], segment_ids=[segments], num_segments=[num])
    (weights,) = weights_from_counts([mask], counts, "sequence_mean", segment_ids=[segments])
    # Sequences [0,4) with 3 tokens, [4,8) with 2, [8,10) with none: S = 2.
    expected = torch.tensor([[0, 1 / 6, 1 / 6, 1 / 6, 0, 0, 1 / 4, 1 / 4, 0, 0]])
    torch.testing.assert_close(weights, expected)
    # Read as one unpacked row, the same mask would be one sequence: the boundaries matter.
    (one_row,) = weights_from_counts([mask], count_tokens([mask]), "sequence_mean")
    assert not torch.allclose(one_row, expected)
