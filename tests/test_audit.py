"""The ``audit`` command: layout names, a passing run, a run with a broken loss that must fail,
and the ``python -m megatron_lossfix`` entry point's help (run end to end by the audit command
of the README and the docs pages in ``tests/test_readme.py``)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from megatron_lossfix.audit import command as audit
from megatron_lossfix.audit.command import AuditLayout, parse_layout
from megatron_lossfix.audit.oracle import layout_grads

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.unit
@pytest.mark.parametrize(
    "name, want",
    [
        ("dp2-m3", AuditLayout("dp2-m3", dp=2, num_microbatches=3)),
        ("tp2-pp2-dp2-m3", AuditLayout("tp2-pp2-dp2-m3", tp=2, pp=2, dp=2, num_microbatches=3)),
        ("pp2-vpp2-m4", AuditLayout("pp2-vpp2-m4", pp=2, vpp=2, num_microbatches=4)),
        ("m1-cp2", AuditLayout("m1-cp2", cp=2, num_microbatches=1)),
    ],
)
def test_parse_layout(name, want):
    assert parse_layout(name) == want


@pytest.mark.unit
@pytest.mark.parametrize("name", ["dp2", "tp2-tp2-m1", "xx-m2", "dp0-m1", "vpp2-m4", "dp2-m3-"])
def test_parse_layout_rejects(name):
    with pytest.raises(ValueError, match="bad layout"):
        parse_layout(name)


@pytest.mark.unit
def test_bad_arguments_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        audit.main(["--modes", "token_mean,nope"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:  # 3 layers cannot be cut into 2 pipeline stages
        audit.main(["--layouts", "pp2-m2", "--num-layers", "3"])
    assert exc.value.code == 2
    assert "not divisible" in capsys.readouterr().err


def _run(pool, tmp_path, *flags, worker=layout_grads):
    argv = ["--layouts", "dp2-m3", "--modes", "token_mean,sum,off", "--out", str(tmp_path)]
    return audit.main([*argv, "--no-progress", *flags], pool=pool, worker=worker)


@pytest.mark.oracle
def test_audit_passes_and_writes_outputs(dist_pool, tmp_path, capsys):
    assert _run(dist_pool, tmp_path) == 0
    report = json.loads((tmp_path / "audit.json").read_text())
    assert report["passed"] is True and report["failures"] == []
    assert report["tolerance"] == 1e-5
    assert [lay["name"] for lay in report["layouts"]] == ["dp2-m3"]
    assert report["layouts"][0]["world_size"] == 2
    errors = report["errors"]
    assert set(errors) == {"token_mean", "sum", "off"}
    assert errors["token_mean"]["dp2-m3"] <= 1e-5 and errors["sum"]["dp2-m3"] <= 1e-5
    # The stock baseline misses on this data: the check can fail, and that is not a failure.
    assert errors["off"]["dp2-m3"] > 1e-3
    rows = {(r["mode"], r["layout"]): r for r in report["results"]}
    assert rows[("token_mean", "dp2-m3")]["loss_rel_error"] <= 1e-5
    assert rows[("off", "dp2-m3")]["passed"] is False
    assert (tmp_path / "audit.png").read_bytes()[:8] == PNG_MAGIC
    out = capsys.readouterr().out
    assert "off (stock Megatron)" in out and "PASS" in out


def _double_scaled_loss(weights, output_tensor, **_):
    """A classic bug: the loss divides the plugin-weighted sum by its own token count again."""
    from megatron_lossfix.runtime.losses import weighted_sum

    num_tokens = (weights != 0).sum(dtype=int)
    return weighted_sum(output_tensor, weights) / num_tokens.clamp(min=1), num_tokens, {}


def _double_scaled_layout_grads(*args, **kwargs):
    # Runs inside the pool's ranks, which the whole test session shares: patch, then restore.
    # The oracle's forward step looks weighted_loss up in its module on every call.
    import megatron_lossfix.runtime.losses as losses

    original = losses.weighted_loss
    losses.weighted_loss = _double_scaled_loss
    try:
        return layout_grads(*args, **kwargs)
    finally:
        losses.weighted_loss = original


@pytest.mark.oracle
def test_audit_fails_on_double_scaled_loss(dist_pool, tmp_path, capsys):
    assert _run(dist_pool, tmp_path, "--no-plot", worker=_double_scaled_layout_grads) == 1
    report = json.loads((tmp_path / "audit.json").read_text())
    assert report["passed"] is False
    assert {(f["mode"], f["layout"]) for f in report["failures"]} == {
        ("token_mean", "dp2-m3"),
        ("sum", "dp2-m3"),
    }
    assert not (tmp_path / "audit.png").exists()
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.oracle
def test_audit_without_matplotlib_still_passes(dist_pool, tmp_path, monkeypatch, capsys):
    """The plain install (`pip install -e .`) has no matplotlib: the table, audit.json, a
    one-line note and exit 0, not an ImportError after the whole matrix."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    assert _run(dist_pool, tmp_path) == 0
    assert json.loads((tmp_path / "audit.json").read_text())["passed"] is True
    assert not (tmp_path / "audit.png").exists()
    out = capsys.readouterr().out
    assert "PASS" in out
    notes = [line for line in out.splitlines() if "matplotlib is not installed" in line]
    assert len(notes) == 1 and "audit.json" in notes[0], out


def _failing_layout_grads(*args, **kwargs):
    """A layout that cannot run: every rank raises before any gradient exists."""
    raise RuntimeError("this layout cannot run here")


@pytest.mark.oracle
def test_a_layout_that_errors_fails_every_row_and_the_exit_status(dist_pool, tmp_path, capsys):
    """No row says ``pass`` (or ``exact here``) without a figure: a layout that raised leaves
    every row of the table unmeasured there, and the audit exits 1."""
    assert _run(dist_pool, tmp_path, "--no-plot", worker=_failing_layout_grads) == 1
    report = json.loads((tmp_path / "audit.json").read_text())
    assert report["passed"] is False
    assert "RuntimeError: this layout cannot run here" in report["layout_errors"]["dp2-m3"]
    assert sorted(report["did_not_run"]) == [[m, "dp2-m3"] for m in ("off", "sum", "token_mean")]
    table = capsys.readouterr().out.splitlines()
    rows = [line for line in table if line.split()[0] in ("off", "token_mean", "sum")]
    assert len(rows) == 3, table
    for row in rows:
        assert " error " in row, row
        assert row.rstrip().endswith("FAIL (did not run on 1/1)"), row
        assert " pass" not in row and "exact here" not in row, row
    assert table[-2].startswith("FAIL: 0 plugin results above tolerance, 1 layout failed to run")


@pytest.mark.unit
def test_table_verdicts_count_cells_that_did_not_run():
    """The table alone (no ranks): a row with a measured miss, a row left unmeasured on one
    layout (baseline or not) and a clean row; only the clean ones may pass."""
    from megatron_lossfix.audit.report import AuditReport, format_table

    ran, broke = parse_layout("dp2-m3"), parse_layout("pp2-m4")
    report = AuditReport(
        options={"tolerance": 1e-5},
        modes=["off", "token_mean", "sum"],
        layouts=[{"name": ran.name, "cp": 1}, {"name": broke.name, "cp": 1}],
    )
    for mode, err in (("off", 0.2), ("token_mean", 1e-7), ("sum", 3e-5)):
        report.add_result(mode, ran, {"error": err}, 1e-5)
    report.add_result("token_mean", broke, {"error": 1e-7}, 1e-5)  # measured before the crash
    report.layout_errors[broke.name] = "RuntimeError: boom"
    rows = {line.split()[0]: line for line in format_table(report).splitlines()}
    assert rows["off"].endswith("FAIL (did not run on 1/2)"), rows["off"]
    assert rows["token_mean"].endswith("  pass"), rows["token_mean"]
    assert rows["sum"].endswith("FAIL (1 layout, did not run on 1/2)"), rows["sum"]
    assert not report.passed and report.did_not_run == [("off", "pp2-m4"), ("sum", "pp2-m4")]
    # A row never measured anywhere fails the verdict even without a recorded layout error.
    report.layout_errors.clear()
    assert not report.passed
    report.add_result("off", broke, {"error": 0.2}, 1e-5)
    report.add_result("sum", broke, {"error": 1e-7}, 1e-5)
    rows = {line.split()[0]: line for line in format_table(report).splitlines()}
    assert rows["off"].endswith("stock baseline: misses 2/2 (allowed)"), rows["off"]
    assert rows["sum"].endswith("FAIL (1 layout)") and not report.passed


# `python -m megatron_lossfix audit` end to end (its own pool, the progress lines, audit.json and
# audit.png) is the README's audit command: tests/test_readme.py runs it and checks what it
# writes (test_audit_entry_point_writes_what_the_readme_says).


@pytest.mark.unit
def test_module_help():
    done = subprocess.run(
        [sys.executable, "-m", "megatron_lossfix", "audit", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0
    for flag in ("--modes", "--layouts", "--out", "--model-size", "--hidden-size", "--tolerance"):
        assert flag in done.stdout
    # The description names the flag that sets where the files go.
    assert "into the --out folder" in " ".join(done.stdout.split())


@pytest.mark.unit
def test_every_audit_flag_with_a_default_says_it():
    """``--help`` shows each flag's default: a flag whose default is a value says
    ``default`` and the value (``--seed``, ``--timeout`` did not)."""
    from megatron_lossfix.audit.options import add_audit_args

    parser = add_audit_args(argparse.ArgumentParser())
    for action in parser._actions:
        if action.default in (None, False, argparse.SUPPRESS):
            continue
        value = f"{action.default:g}" if isinstance(action.default, float) else action.default
        assert "default" in action.help and str(value) in action.help, (
            action.option_strings,
            action.default,
            action.help,
        )


def _unscaled_layout_grads(*args, **kwargs):
    """The deferred normalization removed: a mask_in_loss step leaves its gradients unscaled."""
    import megatron_lossfix.step.after as step_after

    original = step_after.deferred_scale
    step_after.deferred_scale = lambda *a, **k: (1.0, 1.0)
    try:
        return layout_grads(*args, **kwargs)
    finally:
        step_after.deferred_scale = original


@pytest.mark.oracle
@pytest.mark.parametrize("broken", [False, True], ids=["as-is", "without-the-scale"])
def test_audit_mask_in_loss(dist_pool, tmp_path, capsys, broken):
    """--mask-in-loss: every mode as the step chooses and through the counting pass passes; the
    rows counted before the forward miss (token_mean by the dropped fraction). Without the
    scale after the schedule the deferred rows fail, and the audit with them."""
    argv = ["--mask-in-loss", "--layouts", "dp2-m3", "--modes", "token_mean,sum,off"]
    worker = _unscaled_layout_grads if broken else layout_grads
    code = audit.main(
        [*argv, "--out", str(tmp_path), "--no-progress", "--no-plot"], pool=dist_pool, worker=worker
    )
    report = json.loads((tmp_path / "audit.json").read_text())
    rows = {r["mode"]: r for r in report["results"]}
    assert set(rows) == {
        "off",
        "token_mean",
        "token_mean (counting pass)",
        "token_mean (counted before)",
        "sum",
        "sum (counting pass)",
        "sum (counted before)",
    }
    kept = rows["token_mean"]["kept_token_fraction"]
    assert 0.05 < 1 - kept < 0.95
    counted_before = rows["token_mean (counted before)"]
    assert counted_before["grad_rel_error"] == pytest.approx(1 - kept, rel=1e-4)
    assert not counted_before["passed"] and not counted_before["expected_to_pass"]
    assert rows["sum (counted before)"]["passed"]  # nothing is normalized: both meanings agree
    out = capsys.readouterr().out
    assert f"{1 - kept:.1%} of the loss tokens dropped" in out
    if broken:
        assert code == 1 and not report["passed"]
        assert {f["mode"] for f in report["failures"]} == {"token_mean"}
    else:
        assert code == 0 and report["passed"], report["failures"]
        assert rows["token_mean (counting pass)"]["grad_rel_error"] <= 1e-5


# --- stack audits: their rows and where they write, without the frameworks (fake rows) ----


class _FakeStackPool:
    """Answers a stack audit's ``pool.run`` calls without Megatron or the framework: the
    references are one gradient; the stack's worker gives each (row, mode) an error of its own,
    far above the tolerance as released, below it through the adapter; SkyRL's own one-rank
    run (``skyrl-vs-1rank``) is off by yet another amount. Rank 0's answer, as the pool's."""

    max_ranks = 8

    def __init__(self, rows: tuple[str, ...], modes: tuple[str, ...]) -> None:
        self.rows, self.modes = rows, modes

    def run(self, fn, nranks, *args):
        import torch

        ref = {"w": torch.ones(4)}
        if fn.__name__ == "reference_grads":  # the plugin's reference (verl's stack)
            return [{"grads": ref}]
        if fn.__name__ == "skyrl_reference":
            return [ref]
        modes = args[2]  # (layout, case, modes, ...): a stack worker's arguments
        if fn.__name__ == "skyrl_layout_grads":  # SkyRL on one rank, as released
            return [{(self.rows[0], m): {"w": ref["w"] + 5e-4} for m in modes}]
        scale = {self.rows[0]: 1e-3, self.rows[1]: 1e-7}
        return [{(row, m): {"w": ref["w"] + scale[row] * (self.modes.index(m) + 1)}
                 for row in self.rows for m in modes}]  # fmt: skip


def _fake_stack_audit(monkeypatch, tmp_path, capsys, stack: str, *flags: str):
    """``audit --stack STACK FLAGS`` in ``tmp_path`` on the fake pool; (exit status, stdout)."""
    from megatron_lossfix.audit.stacks import load_stack

    module = load_stack(stack)
    rows = getattr(module, "ROWS", None) or (module.ROW, module.ADAPTED_ROW)
    modes = tuple(module.MODES)
    monkeypatch.setattr(audit, "_require_stack", lambda name: None)  # not installed here
    monkeypatch.chdir(tmp_path)
    worker = _FakeStackPool(rows, modes)
    status = audit.main(
        ["--stack", stack, "--layouts", "dp2-m3", "--no-plot", "--no-progress", *flags],
        pool=worker,
        stack_worker=lambda *a, **k: None,  # the fake pool answers in its place
    )
    return status, capsys.readouterr().out


def _table_rows(out: str) -> list[str]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("mode ")) + 1
    end = next(i for i, line in enumerate(lines) if line.startswith(("PASS", "FAIL")))
    return [line.split()[0] for line in lines[start:end]]


@pytest.mark.unit
@pytest.mark.parametrize("stack, mode", [("skyrl", "prompt_mean"), ("verl", "token-mean")])
def test_a_stack_audit_of_one_mode_prints_each_row_once(monkeypatch, tmp_path, capsys, stack, mode):
    """One mode: the worst-mode rows are that mode's rows; printing ``<stack>:<mode>`` beside
    ``<stack>`` would repeat them. With two modes both kinds are there, the worst the larger."""
    _, out = _fake_stack_audit(monkeypatch, tmp_path, capsys, stack, "--modes", mode)
    rows = _table_rows(out)
    assert len(rows) == len(set(rows)), out
    assert stack in rows and f"{stack}+lossfix" in rows, out
    assert not [r for r in rows if r.endswith(f":{mode}") and not r.startswith(f"{stack}-")], out
    report = json.loads((tmp_path / "audit-out" / stack / "audit.json").read_text())
    values = [tuple(v.values()) for v in report["errors"].values()]
    assert len(values) == len(set(values)), report["errors"]  # no row repeats another's figures

    from megatron_lossfix.audit.stacks import load_stack

    two = tuple(load_stack(stack).MODES)[-2:]
    _, out = _fake_stack_audit(monkeypatch, tmp_path, capsys, stack, "--modes", ",".join(two))
    rows = _table_rows(out)
    assert len(rows) == len(set(rows)) and {f"{stack}:{m}" for m in two} <= set(rows), out
    errors = json.loads((tmp_path / "audit-out" / stack / "audit.json").read_text())["errors"]
    assert errors[stack]["dp2-m3"] == max(errors[f"{stack}:{m}"]["dp2-m3"] for m in two)


@pytest.mark.unit
@pytest.mark.parametrize(
    "flags, folder",
    [
        (["--stack", "skyrl"], "audit-out/skyrl"),
        (["--stack", "skyrl", "--modes", "prompt_mean"], "audit-out/skyrl"),
        (["--stack", "skyrl", "--terms", "sft"], "audit-out/skyrl-sft"),
        (["--stack", "verl"], "audit-out/verl"),
        (["--mask-in-loss"], "audit-out/mask-in-loss"),
        ([], "audit-out"),
        (["--stack", "skyrl", "--out", "elsewhere"], "elsewhere"),
    ],
)
def test_each_kind_of_audit_writes_to_a_folder_of_its_own(flags, folder):
    """Without ``--out`` no kind of audit overwrites another's audit.json (the --help says
    where each writes)."""
    from megatron_lossfix.audit.options import add_audit_args, default_out, options_from_args

    args = add_audit_args(argparse.ArgumentParser()).parse_args(flags)
    assert (args.out or default_out(options_from_args(args))) == folder


@pytest.mark.unit
def test_a_stack_audit_writes_where_it_says(monkeypatch, tmp_path, capsys):
    """``audit --stack skyrl --modes prompt_mean``: its own folder, the last line names it, and
    the plugin audit's audit.json is left alone."""
    main = tmp_path / "audit-out" / "audit.json"
    main.parent.mkdir()
    main.write_text("{}")
    status, out = _fake_stack_audit(
        monkeypatch, tmp_path, capsys, "skyrl", "--modes", "prompt_mean"
    )
    assert status == 0, out
    assert out.splitlines()[-1] == "wrote audit-out/skyrl/audit.json"
    assert main.read_text() == "{}" and (tmp_path / "audit-out/skyrl/audit.json").is_file()


def _gpt_notices_shown() -> list[str]:
    """In a pool rank: what Megatron-Core's GPTModel logger passes on of its deprecation notice
    and of another message (what a handler there, or Python's last-resort one, would print)."""
    import logging

    from megatron_lossfix.audit.pool import GPT_MODEL_LOGGER

    logger, seen = logging.getLogger(GPT_MODEL_LOGGER), []
    handler = logging.Handler()
    handler.emit = seen.append
    logger.addHandler(handler)
    try:
        logger.warning("GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes")
        logger.warning("another notice")
    finally:
        logger.removeHandler(handler)
    return [r.getMessage() for r in seen]


@pytest.mark.oracle
def test_the_pools_ranks_drop_gpt_models_deprecation_notice(dist_pool):
    """Every model the audit builds is its own tiny GPT: the ranks drop Megatron-Core 0.19's
    notice for each (12 lines in a stack audit), and nothing else."""
    assert dist_pool.run(_gpt_notices_shown, 1)[0] == ["another notice"]
