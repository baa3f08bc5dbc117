"""End-to-end: ``examples/grpo_gpt.py`` under torchrun, and its rollout handling in-process.

Replayed rollouts (``--rollouts``) under two layouts must give the same loss and grad norm (1e-5
relative, 3 iterations) and the same RL statistics; with ``--loss-reduction off`` they must not.
A short sampling-mode run checks that the sample -> reward -> GRPO -> update loop completes.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
from pathlib import Path

import pytest
from test_examples import ROOT, TOL, ExampleRuns, max_rel_diff

SCRIPT = "grpo_gpt.py"
#: log(1/264): every token's log-prob under the (near-uniform) initial model.
UNIFORM_LOGP = -math.log(264)
RL_STATS = ("pg_loss", "entropy", "kl", "clip_frac_low", "clip_frac_high", "dual_clip_frac",
            "ratio_mean", "ratio_min", "ratio_max")  # fmt: skip


def write_rollouts(path: Path, n: int = 24, seed: int = 0) -> Path:
    """Deterministic rollouts of very different lengths; two in three carry ``old_logprobs``
    (off-policy: ratios far enough from 1 to clip, a few past the dual-clip bound), the rest are
    on-policy; every one carries ``ref_logprobs``."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            prompt = [rng.randrange(256) for _ in range(rng.randint(1, 8))]
            response = [rng.randrange(258) for _ in range(rng.randint(1, 24))]
            record = {"prompt_ids": prompt, "response_ids": response,
                      "advantage": round(rng.gauss(0.0, 1.0), 4)}  # fmt: skip
            if i % 3:
                record["old_logprobs"] = [UNIFORM_LOGP + rng.gauss(0, 0.6) for _ in response]
            record["ref_logprobs"] = [UNIFORM_LOGP + rng.gauss(0, 0.3) for _ in response]
            f.write(json.dumps(record) + "\n")
    return path


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory) -> Path:
    return write_rollouts(tmp_path_factory.mktemp("rollouts") / "rollouts.jsonl")


def write_grouped_rollouts(path: Path, seed: int = 1) -> Path:
    """GRPO-style rollouts: prompts with 5, 3, 4, 6, 2 and 4 responses, written consecutively
    (each prompt's responses are its group), response lengths 1 to 24."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for size in (5, 3, 4, 6, 2, 4):
            prompt = [rng.randrange(256) for _ in range(rng.randint(1, 8))]
            for _ in range(size):
                response = [rng.randrange(258) for _ in range(rng.randint(1, 24))]
                old = [UNIFORM_LOGP + rng.gauss(0, 0.6) for _ in response]
                advantage = round(rng.gauss(0.0, 1.0), 4)
                record = {"prompt_ids": prompt, "response_ids": response,
                          "advantage": advantage, "old_logprobs": old}  # fmt: skip
                f.write(json.dumps(record) + "\n")
    return path


@pytest.fixture(scope="module")
def grouped_rollouts(tmp_path_factory) -> Path:
    return write_grouped_rollouts(tmp_path_factory.mktemp("rollouts") / "grouped.jsonl")


def common(rollouts: Path) -> list[str]:
    return ["--rollouts", str(rollouts), "--train-iters", "3", "--global-batch-size", "12",
            "--seq-length", "32", "--hidden-size", "32", "--num-layers", "2"]  # fmt: skip


def assert_rl_stats_agree(one: list[dict], two: list[dict]) -> None:
    for a, b in zip(one, two, strict=True):
        for key in RL_STATS:
            if a[key] is None or b[key] is None:
                assert a[key] is b[key] is None, (key, a[key], b[key])
            else:
                assert math.isclose(a[key], b[key], rel_tol=TOL, abs_tol=1e-7), (key, a, b)


PPO = ["--dual-clip-c", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> ExampleRuns:
    """Each distinct launch once; a test's launches not run yet start side by side."""
    return ExampleRuns(tmp_path_factory.mktemp("grpo-runs"), SCRIPT)


def ppo_reference(rollouts: Path) -> tuple[int, list[str]]:
    """One rank, one micro-batch: the layout every other PPO run is compared with."""
    return 1, [*common(rollouts), *PPO, "--micro-batch-size", "12"]


@pytest.mark.e2e
def test_ppo_rollouts_layouts_agree(runs, rollouts):
    """DP=2 with 3 micro-batches per rank against one rank with one micro-batch; the RL
    statistics agree too."""
    # check_finite also inspects every micro-batch input: the rollout tensors must be finite.
    one, two = runs.get(
        ppo_reference(rollouts),
        (2, [*common(rollouts), *PPO, "--micro-batch-size", "2", "--lossfix-check-finite"]),
    )
    assert len(one) == len(two) == 3
    for rec in one:
        assert {"iteration", "loss", "grad_norm", "num_tokens", "step_time_s", *RL_STATS} <= set(
            rec
        )
    assert [r["num_tokens"] for r in one] == [r["num_tokens"] for r in two]
    loss_diff, norm_diff = max_rel_diff(one, two, "loss"), max_rel_diff(one, two, "grad_norm")
    assert loss_diff <= TOL and norm_diff <= TOL, (loss_diff, norm_diff, one, two)
    assert_rl_stats_agree(one, two)
    # The data really exercises the clipped branches (else the invariance would be weaker).
    assert max(r["clip_frac_low"] for r in one) > 0 and max(r["clip_frac_high"] for r in one) > 0
    assert max(r["dual_clip_frac"] for r in one) > 0
    assert all(r["ratio_min"] < 1 < r["ratio_max"] for r in one)


# In noxfile.RELEASE_TESTS: every megatron-core release builds and trains these layouts.
@pytest.mark.e2e
def test_ppo_rollouts_pp2_and_moe_layouts_agree(runs, rollouts):
    """A model with 4 experts per layer: one rank with one micro-batch against PP2 and against
    DP2 with the experts split over both ranks (EP2), 3 micro-batches a rank; the RL
    statistics agree too. (MTP: the script refuses it, test_grpo_mistakes_end_in_one_line.)"""
    moe = [*common(rollouts), *PPO, "--num-experts", "4"]
    one, pp2, ep2 = runs.get(
        (1, [*moe, "--micro-batch-size", "12"]),
        (2, [*moe, "--micro-batch-size", "4", "--pipeline-model-parallel-size", "2"]),
        (2, [*moe, "--micro-batch-size", "2", "--expert-model-parallel-size", "2"]),
    )
    for name, two in (("pp2", pp2), ("dp2-ep2", ep2)):
        loss_diff, norm_diff = max_rel_diff(one, two, "loss"), max_rel_diff(one, two, "grad_norm")
        assert loss_diff <= TOL and norm_diff <= TOL, (name, loss_diff, norm_diff, one, two)
        assert_rl_stats_agree(one, two)


@pytest.mark.e2e
def test_ppo_rollouts_stock_megatron_disagrees(runs, rollouts):
    """With the plugin off, the 2-rank, 3-micro-batch run averages per micro-batch. (With one
    micro-batch on one rank, off and token_mean are the same computation.)"""
    one, off = runs.get(
        ppo_reference(rollouts),
        (2, [*common(rollouts), *PPO, "--micro-batch-size", "2", "--loss-reduction", "off"]),
    )
    loss_diff = max_rel_diff(one, off, "loss")
    norm_diff = max_rel_diff(one, off, "grad_norm")
    assert max(loss_diff, norm_diff) > 1e-3, f"stock Megatron agreed: {loss_diff}, {norm_diff}"


@pytest.mark.e2e
def test_group_mean_rollouts_layouts_agree(runs, grouped_rollouts):
    """group_mean over the rollouts' prompt groups (which straddle the 2 ranks' slices and
    their micro-batches) against one rank with one micro-batch; token_mean weighs the same
    steps differently (the check can fail)."""
    group = [*common(grouped_rollouts), *PPO, "--loss-reduction", "group_mean"]
    one, two, token = runs.get(
        (1, [*group, "--micro-batch-size", "12"]),
        (2, [*group, "--micro-batch-size", "2"]),
        (1, [*common(grouped_rollouts), *PPO, "--micro-batch-size", "12"]),
    )
    loss_diff, norm_diff = max_rel_diff(one, two, "loss"), max_rel_diff(one, two, "grad_norm")
    assert loss_diff <= TOL and norm_diff <= TOL, (loss_diff, norm_diff, one, two)
    assert_rl_stats_agree(one, two)
    # 24 records of 6 prompts, 12 a step: the first step holds 3 groups (5 + 3 + 4), the second
    # 3 (6 + 2 + 4), the third the first again.
    assert [r["num_groups"] for r in one] == [3, 3, 3], one
    assert max_rel_diff(one, token, "grad_norm") > 1e-3


# GSPO with every regularizer, sequence-level weights; attention-free so that CP2 is exact on CPU.
GSPO = ["--policy-loss", "gspo", "--kl-coef", "0.1", "--kl-estimator", "k3",
        "--entropy-coef", "0.01", "--loss-reduction", "sequence_mean", "--no-attention",
        "--clip-eps-high", "0.28"]  # fmt: skip


@pytest.mark.e2e
@pytest.mark.parametrize(
    "layout_args",
    [
        ["--tensor-model-parallel-size", "2", "--micro-batch-size", "4"],
        ["--context-parallel-size", "2", "--micro-batch-size", "4"],
    ],
    ids=["tp2", "cp2"],
)
def test_gspo_kl_entropy_layouts_agree(runs, rollouts, layout_args):
    """Vocab-parallel log-probs and entropy (TP2), sequence ratios and weights split over CP
    ranks (CP2); 3 micro-batches each, against one rank with one micro-batch."""
    one, two = runs.get(
        (1, [*common(rollouts), *GSPO, "--micro-batch-size", "12"]),
        (2, [*common(rollouts), *GSPO, *layout_args]),
    )
    loss_diff, norm_diff = max_rel_diff(one, two, "loss"), max_rel_diff(one, two, "grad_norm")
    assert loss_diff <= TOL and norm_diff <= TOL, (layout_args, loss_diff, norm_diff, one, two)
    assert_rl_stats_agree(one, two)
    assert all(r["kl"] > 0 and r["entropy"] > 0 for r in one)


SAMPLING = ["--train-iters", "3", "--prompts-per-step", "3", "--num-generations", "4",
            "--micro-batch-size", "3", "--max-new-tokens", "6", "--hidden-size", "32",
            "--kl-coef", "0.05"]  # fmt: skip


@pytest.mark.e2e
def test_sampling_mode_runs_and_is_layout_free(runs):
    """Sample -> reward -> GRPO advantages -> update, with the KL reference model, on 2 DP ranks
    (prompt groups of 4 straddle their slices of 6) and on 1: rewards are fractions in [0, 1],
    and the sampling noise belongs to the sequence, so both runs draw the same responses and
    take the same steps."""
    two, one = runs.get((2, SAMPLING), (1, SAMPLING))
    assert [r["iteration"] for r in two] == [1, 2, 3]
    for rec in two:
        assert 0.0 <= rec["reward_mean"] <= 1.0
        assert 0.0 < rec["response_length_mean"] <= 6
        assert rec["num_sequences"] == 12 and rec["num_tokens"] > 0
        assert math.isfinite(rec["loss"]) and math.isfinite(rec["grad_norm"])
        assert rec["kl"] is not None and rec["kl"] >= 0
        assert rec["ratio_min"] == pytest.approx(1.0) == rec["ratio_max"]  # on-policy
    assert two[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before updates
    assert [r["reward_mean"] for r in one] == [r["reward_mean"] for r in two]
    assert max_rel_diff(one, two, "grad_norm") <= TOL
    # On-policy, equal-length groups: the loss can be ~0, so compare it absolutely.
    assert all(abs(a["loss"] - b["loss"]) <= 1e-6 for a, b in zip(one, two, strict=True))


@pytest.mark.e2e
def test_sampling_mode_group_mean_is_layout_free(runs):
    """group_mean over the sampler's prompt groups (4 responses of a prompt, straddling the 2
    ranks' slices of 6) against one rank: the same steps; token_mean weighs them differently
    once response lengths differ (from the second step), so the check can fail."""
    group = [*SAMPLING, "--loss-reduction", "group_mean"]
    two, one, token = runs.get((2, group), (1, group), (1, SAMPLING))
    assert [r["num_groups"] for r in two] == [3, 3, 3], two
    assert max_rel_diff(one, two, "grad_norm") <= TOL
    assert all(abs(a["loss"] - b["loss"]) <= 1e-6 for a, b in zip(one, two, strict=True))
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(one, token, strict=True)) > 1e-4


# ------------------------------------------------------------------ in-process: rollout files


@pytest.fixture(scope="module")
def grpo():
    spec = importlib.util.spec_from_file_location("grpo_gpt", ROOT / "examples" / SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.unit
def test_encode_rollouts_puts_response_tokens_under_the_mask(grpo):
    records = [
        {"prompt_ids": [1, 2, 3], "response_ids": [4, 5], "advantage": 0.5,
         "old_logprobs": [-1.0, -2.0], "ref_logprobs": [-3.0, -4.0]},
        {"prompt_ids": [7], "response_ids": [8, 9, 10], "advantage": -1.0,
         "old_logprobs": None, "ref_logprobs": [-1.0, -1.0, -1.0]},
    ]  # fmt: skip
    batch = grpo.encode_rollouts(records, 6, 256, with_ref=True)
    assert batch["tokens"][0].tolist() == [1, 2, 3, 4, 256, 256]
    assert batch["labels"][0].tolist() == [2, 3, 4, 5, 256, 256]
    assert batch["loss_mask"][0].tolist() == [0, 0, 1, 1, 0, 0]
    assert batch["advantages"][0].tolist() == [0, 0, 0.5, 0.5, 0, 0]
    assert batch["old_logprobs"][0, 2:4].tolist() == [-1.0, -2.0]
    assert batch["ref_logprobs"][0, 2:4].tolist() == [-3.0, -4.0]
    # A one-token prompt: the first response token is predicted at position 0.
    assert batch["loss_mask"][1].tolist() == [1, 1, 1, 0, 0, 0]
    assert batch["has_old_logprobs"][0].tolist() == [0, 0, 1, 1, 0, 0]
    assert not batch["has_old_logprobs"][1].any()  # on-policy: no recorded log-probs


@pytest.mark.parametrize(
    ("record", "kwargs", "message"),
    [
        ({"prompt_ids": [1], "response_ids": [2], "advantage": 1.0}, {"need_ref": True},
         "ref_logprobs"),
        ({"prompt_ids": [1], "response_ids": [2, 3], "advantage": 1.0, "old_logprobs": [0.0]},
         {}, "one log-prob per response token"),
        ({"prompt_ids": [1] * 8, "response_ids": [2] * 8, "advantage": 1.0}, {},
         "--seq-length"),
        ({"prompt_ids": [], "response_ids": [2], "advantage": 1.0}, {}, "empty"),
        ({"prompt_ids": [1], "response_ids": [999], "advantage": 1.0}, {}, "vocabulary"),
        ({"prompt_ids": [1], "response_ids": [2], "advantage": "high"}, {}, "advantage"),
    ],
    ids=["missing-ref", "logprob-length", "too-long", "empty-prompt", "bad-id", "bad-advantage"],
)  # fmt: skip
@pytest.mark.unit
def test_load_rollouts_rejects_bad_records(grpo, tmp_path, record, kwargs, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=message) as info:
        grpo.load_rollouts(str(path), vocab=264, seq_length=12, **{"need_ref": False, **kwargs})
    assert "line 1" in str(info.value)


@pytest.mark.unit
def test_sampling_flags_are_checked(grpo):
    args = grpo.parse_args(["--prompts-per-step", "3", "--num-generations", "4"])
    assert args.global_batch_size == 12
    args = grpo.parse_args(["--global-batch-size", "32", "--num-generations", "8"])
    assert args.prompts_per_step == 4
    for bad in (["--global-batch-size", "10", "--num-generations", "4"],
                ["--policy-loss", "gspo", "--dual-clip-c", "3"],
                ["--temperature", "0"]):  # fmt: skip
        with pytest.raises(SystemExit):
            grpo.parse_args(bad)


@pytest.mark.unit
def test_task_reward_counts_class_bytes_and_penalizes_early_stop():
    from grpo_task import task_reward

    digits = frozenset(b"0123456789")
    assert task_reward(list(b"12a4"), digits, 257, 4) == 0.75
    assert task_reward([*b"12", 257], digits, 257, 4) == 0.5  # eos: the rest scores 0
