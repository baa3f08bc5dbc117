"""``python -m megatron_lossfix rl-replay compare``: stock Megatron-LM against the plugin, 1 rank
against 2 data-parallel ranks, through the RL replay of ``train_rl.py``
(:mod:`~megatron_lossfix.integrations.megatron_lm.rl_replay`) on fixed rollouts.

:func:`compare` runs one launch per layout, two collections at learning rate 0 (stock, then the
plugin's mode) of the same rollouts, and prints what each optimizer step trained and the
relative differences between the layouts (the ``steps`` set: three optimizer steps per
collection).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_lossfix.integrations.megatron_lm.patches import PatchError, check_checkout
from megatron_lossfix.integrations.megatron_lm.rl_plans import (
    MODULE,
    PLAN_ENV,
    SETS,
    SHAPES,
    checkout_null_tokenizer_eod,
    rl_args,
    rollout_sets,
    write_plan,
)
from megatron_lossfix.integrations.megatron_lm.rl_records import read_records

__all__ = ["REL", "compare", "main"]

#: Largest relative difference between 1 rank and DP2 that counts as the same step.
REL = 1e-6


def _free_port() -> str:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        return str(free.getsockname()[1])


def _rank_env(tree: Path, plan: Path, rank: int, nproc: int, port: str) -> dict[str, str]:
    """What ``torchrun --standalone`` gives a rank, with the checkout first on the path."""
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[3])  # this package, installed or not
    paths = [str(tree), package_root, env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    # Megatron-LM compiles its dataset helpers with `make`, which calls python3: this one.
    bins = [os.path.dirname(sys.executable), os.path.join(sys.base_prefix, "bin")]
    env["PATH"] = os.pathsep.join([*bins, env.get("PATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    env |= {PLAN_ENV: str(plan), "RANK": str(rank), "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}  # fmt: skip
    return env


def _launch(tree: Path, plan: Path, args: list[str], nproc: int, logs: Path,
            timeout: float) -> list[str]:  # fmt: skip
    """Run this module on ``nproc`` ranks as plain processes (each rank's output of its own,
    so that every rank says why it stopped); the ranks' outputs."""
    port = _free_port()
    procs, files = [], []
    for rank in range(nproc):
        log = logs / f"ranks{nproc}.rank{rank}.log"
        files.append(log)
        with log.open("w") as out:
            cmd = [sys.executable, "-m", MODULE, *args]
            procs.append(subprocess.Popen(cmd, cwd=tree, env=_rank_env(tree, plan, rank, nproc,
                                          port), stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL))  # fmt: skip
    deadline = time.monotonic() + timeout
    failed_at = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now  # a rank failed: its peers get a minute to say why, then stop
        if now > deadline or (failed_at is not None and now > failed_at + 60):
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            break
        time.sleep(0.5)
    return [log.read_text(errors="replace") for log in files]


#: The plugin's refusal in a rank's output (torch prefixes a rank's traceback with its rank).
_REFUSAL = re.compile(r"^(?:\[rank\d+\]:\s*)?ValueError: (megatron_lossfix: .*)$", re.M)


def _refusal(outputs: list[str]) -> str | None:
    """The plugin's one-line refusal, when every rank printed the same one."""
    lines = set()
    for output in outputs:
        found = _REFUSAL.findall(output)
        if not found:
            return None
        lines.add(found[-1])
    return lines.pop() if len(lines) == 1 else None


def compare(
    megatron_lm_path: str | os.PathLike,
    *,
    rollout_set: str = "multi",
    loss_reduction: str = "token_mean",
    loss_norm_constant: float | None = None,
    per_token: bool = False,
    out: str | os.PathLike = "out/rl-compare",
    timeout: float = 1800,
    echo: Any = print,
) -> int:
    """Stock Megatron-LM against the plugin, 1 rank against 2 data-parallel ranks, on the
    rollout set ``rollout_set``: one launch per layout, two iterations at learning rate 0
    (stock, then ``loss_reduction``) on the same rollouts. Prints what each step trained and
    the relative differences between the layouts; returns 0 when the plugin's agree to
    :data:`REL`, 1 when they do not, 2 when a launch failed (a refusal: its line)."""
    try:  # what `patches apply` says of a directory that is not a Megatron-LM checkout
        tree = check_checkout(Path(megatron_lm_path))
    except PatchError as err:
        echo(f"megatron_lossfix: {err}")
        return 2
    train_rl = tree / "train_rl.py"
    if not train_rl.is_file() or "megatron_lossfix" not in train_rl.read_text():
        echo(f"megatron_lossfix: {train_rl} is not patched; run python -m "
             f"megatron_lossfix.patches apply {megatron_lm_path} first")  # fmt: skip
        return 2
    folder = Path(out).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    sets = rollout_sets(checkout_null_tokenizer_eod(tree))
    prompts, group = SHAPES.get(rollout_set, (2, 2))
    per_collection = prompts * group // 4  # optimizer steps of --global-batch-size 4
    steps = [{"rollouts": sets[rollout_set], "loss_reduction": mode,
              "loss_norm_constant": loss_norm_constant if mode else None}
             for mode in (None, loss_reduction) for _ in range(per_collection)]  # fmt: skip
    records: dict[int, list[dict]] = {}
    refused: dict[int, str | None] = {}
    for nproc in (1, 2):
        records_out = folder / f"ranks{nproc}.jsonl"
        for old in folder.glob(f"ranks{nproc}.*"):
            old.unlink()
        plan = write_plan(folder / f"ranks{nproc}.plan.json", tree, steps, out=records_out)
        args = rl_args(train_iters=len(steps), per_token=per_token, rollout_set=rollout_set)
        outputs = _launch(tree, plan, args, nproc, folder, timeout)
        records[nproc] = read_records(records_out) if records_out.is_file() else []
        short = len(records[nproc]) < len(steps)
        refused[nproc] = _refusal(outputs) if short else None
        if short and refused[nproc] is None:
            echo(outputs[-1][-4000:])
            echo(f"megatron_lossfix: the {nproc}-rank launch failed; its ranks' output is in "
                 f"{folder}")  # fmt: skip
            return 2
    flags = f"--loss-reduction {loss_reduction}" + (
        " --calculate-per-token-loss" if per_token else ""
    )
    echo(f"train_rl.py, rollout set {rollout_set!r}, learning rate 0: stock, then {flags}"
         + ("" if per_collection == 1 else
            f"; {per_collection} optimizer steps per collection"))  # fmt: skip
    worst = _print_steps(records, refused, echo, per_collection)
    if any(refused.values()):
        return 2
    echo(f"plugin: {'exact' if worst <= REL else 'NOT exact'} (largest difference {worst:.1e}, "
         f"tolerance {REL:.0e})")  # fmt: skip
    return 0 if worst <= REL else 1


def _print_steps(
    records: dict[int, list[dict]], refused: dict[int, str | None], echo: Any, per_collection: int
) -> float:
    """Print what each optimizer step trained on 1 and 2 ranks, then their relative
    differences; the largest difference of the plugin's steps (0 when a layout refused them)."""
    labels = [
        name if per_collection == 1 else f"{name} {k + 1}"
        for name in ("stock", "plugin")
        for k in range(per_collection)
    ]
    width = max(8, *(len(label) + 1 for label in labels))
    echo(f"{'':{width}}{'ranks':>6}{'sequences':>11}{'tokens':>8}{'loss':>12}{'grad norm':>12}")
    for step, name in enumerate(labels):
        for nproc in (1, 2):
            if step >= len(records[nproc]):
                if step % per_collection == 0:
                    echo(f"{name:{width}}{nproc:>6}  refused: {refused[nproc]}")
                continue
            r = records[nproc][step]
            echo(f"{name:{width}}{nproc:>6}{r['num_sequences']:>11}{r['num_tokens']:>8}"
                 f"{r['lm_loss']:>12.6g}{r['grad_norm']:>12.6g}")  # fmt: skip
    echo("relative difference, 1 rank against DP2:")
    echo(f"{'':{width}}{'loss':>10}{'grad norm':>11}{'gradient':>10}{'num_tokens':>12}")
    worst = 0.0
    for step, name in enumerate(labels):
        if any(step >= len(records[n]) for n in (1, 2)):
            if step % per_collection == 0:
                echo(f"{name:{width}}  refused")
            continue
        one, two = records[1][step], records[2][step]
        diffs = [
            abs(one["lm_loss"] - two["lm_loss"]) / abs(one["lm_loss"]),
            abs(one["grad_norm"] - two["grad_norm"]) / one["grad_norm"],
            float((one["grad"] - two["grad"]).norm() / one["grad"].norm()),
            abs(one["num_tokens"] - two["num_tokens"]) / max(one["num_tokens"], 1),
        ]
        echo(
            f"{name:{width}}"
            + "".join(f"{d:>{w}.1e}" for d, w in zip(diffs, (10, 11, 10, 12), strict=True))
        )
        if name.startswith("plugin"):
            worst = max(worst, *diffs)
    return worst


def main(argv: Sequence[str], prog: str) -> int:
    """The ``compare`` command: its flags ``argv`` (without the word ``compare``)."""
    parser = argparse.ArgumentParser(
        prog=f"{prog} compare",
        description="Stock Megatron-LM against the plugin, 1 rank against 2 data-parallel "
        "ranks, on fixed rollouts (CPU or GPU); exits 0 when the plugin's agree, 1 when "
        "not, 2 when a launch failed or was refused.",
    )
    parser.add_argument("megatron_lm_path", help="the patched Megatron-LM checkout")
    parser.add_argument("--set", default="multi", choices=SETS,
                        help="the rollouts of both collections (rollout_sets; steps: three "
                        "optimizer steps per collection)")  # fmt: skip
    parser.add_argument(
        "--loss-reduction",
        default="token_mean",
        help="the plugin's mode (train_rl.py's --loss-reduction)",
    )
    parser.add_argument(
        "--loss-norm-constant",
        type=float,
        default=None,
        help="Dr. GRPO's constant (seq_mean_token_sum_norm)",
    )
    parser.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="run both steps with Megatron-LM's per-token path",
    )
    parser.add_argument(
        "--out", default="out/rl-compare", help="folder of the plans, records and ranks' logs"
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a launch may run")
    options = parser.parse_args(list(argv))
    return compare(options.megatron_lm_path, rollout_set=options.set,
                   loss_reduction=options.loss_reduction,
                   loss_norm_constant=options.loss_norm_constant,
                   per_token=options.calculate_per_token_loss, out=options.out,
                   timeout=options.timeout)  # fmt: skip
