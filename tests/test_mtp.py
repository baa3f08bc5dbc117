"""Multi-token prediction: every MTP layer's loss normalized like the main loss, exactly.

Megatron computes each MTP layer's loss inside GPTModel and divides it by local counts; the
plugin hands it the mode's weights over each layer's shifted masks instead. The reference
(``oracle.reference_grads``) computes the MTP losses itself from the logits the model's output
layer produced for the MTP layers, with Megatron's own MTP backward silenced; on one rank and one
micro-batch, stock Megatron's MTP (``off``) equals it for token_mean, which pins the reference to
Megatron's semantics (MTP layer j predicts the label j positions ahead, scaled by
``mtp_loss_scaling_factor / mtp_num_layers``).
"""

from __future__ import annotations

import math

import pytest
import torch
from packaging.version import Version

from megatron_lossfix import REDUCTIONS
from megatron_lossfix.audit.matrix import check_layout
from megatron_lossfix.audit.oracle import OracleCase
from megatron_lossfix.audit.tiny_gpt import Layout
from megatron_lossfix.runtime.weights import shifted_masks
from megatron_lossfix.step.megatron_compat import megatron_core_version

pytestmark = pytest.mark.oracle

TOL = 1e-5
MODES = (*REDUCTIONS, "off")
#: Learned absolute positions would need their gradient summed over pipeline stages (the last
#: stage's MTP layers use a copy of the embedding), which Megatron does only for word
#: embeddings; MTP models use RoPE.
ROPE = {"position_embedding_type": "rope"}


def test_shifted_masks_match_megatrons_roll():
    mask = torch.tensor([[0.0, 1, 1, 0, 1], [1, 1, 1, 1, 1]])
    assert shifted_masks([mask], 0)[0].equal(mask)
    assert shifted_masks([mask], 1)[0].equal(torch.tensor([[1.0, 1, 0, 1, 0], [1, 1, 1, 1, 0]]))
    assert shifted_masks([mask], 2)[0].equal(torch.tensor([[1.0, 0, 1, 0, 0], [1, 1, 1, 0, 0]]))
    assert not shifted_masks([mask], 7)[0].any()
    with pytest.raises(ValueError, match="shift"):
        shifted_masks([mask], -1)


def assert_mtp_exact(checks: dict, layers: int, what: str, modes=REDUCTIONS) -> None:
    for mode in modes:
        check = checks[mode]
        assert check["error"] <= TOL, f"{what} {mode}: main + MTP gradient error {check['error']}"
        metrics, ref = check["result"]["metrics"], check["reference"]
        assert metrics["loss"] == pytest.approx(ref["loss"], rel=TOL), (what, mode)
        for j in range(1, layers + 1):
            key = f"mtp_loss_{j}"
            assert metrics[key] == pytest.approx(ref[key], rel=TOL), (what, mode, key)
            assert math.isfinite(metrics[key])


LAYOUTS = {
    "m4": (Layout(), 1, 4, {}),
    "dp2-m3": (Layout(), 2, 3, {}),
    "pp2-m3": (Layout(pp=2), 2, 3, ROPE),
    "cp2-m3": (Layout(cp=2), 2, 3, {"no_attention": True}),
    "ep2-m3": (Layout(ep=2), 2, 3, {"num_experts": 4}),
}
CASES = [
    *[(name, layers, False) for layers in (1, 2) for name in LAYOUTS],
    ("m4", 2, True),
    ("pp2-m3", 2, True),
]


@pytest.mark.parametrize(
    "name, layers, per_token",
    CASES,
    ids=[f"{n}-mtp{k}{'-per-token' if p else ''}" for n, k, p in CASES],
)
def test_mtp_gradient_is_layout_invariant(dist_pool, name, layers, per_token):
    layout, world, m, model_kwargs = LAYOUTS[name]
    case = OracleCase(model_kwargs={**model_kwargs, "mtp_num_layers": layers}, per_token=per_token)
    # One MTP layer: the modes with global counts and stock; two layers: every mode.
    modes = MODES if layers > 1 else ("token_mean", "sequence_mean", "off")
    checks = check_layout(dist_pool, case, layout, world, m, modes)
    print(f"\nMTP oracle {name} mtp{layers}{' per-token' if per_token else ''}: "
          + ", ".join(f"{mode} {checks[mode]['error']:.2e}" for mode in modes))  # fmt: skip
    assert_mtp_exact(checks, layers, name, modes=[mode for mode in modes if mode != "off"])
    # Stock Megatron averages each MTP layer per micro-batch and rank (and, under CP, misses
    # the CP factor): the same check fails.
    assert checks["off"]["error"] > 1e-4, checks["off"]["error"]


@pytest.mark.parametrize("per_token", [False, True], ids=["mean-path", "per-token-path"])
def test_stock_mtp_on_one_rank_is_the_reference(dist_pool, per_token):
    """One rank, one micro-batch: Megatron's own MTP loss (``off``) and the reference agree
    (token_mean), so the reference is Megatron's MTP semantics, not the plugin's reading of
    them; the plugin's modes agree too.

    Megatron's per-token path before 0.17 divided each MTP layer by the main loss's token
    count rather than its own (shifted) count; 0.17 rescaled it to the layer's count, as here.
    """
    case = OracleCase(model_kwargs={"mtp_num_layers": 2}, per_token=per_token)
    checks = check_layout(dist_pool, case, Layout(), 1, 1, ("token_mean", "sequence_mean", "off"))
    if per_token and megatron_core_version() < Version("0.17"):
        assert checks["off"]["error"] > 1e-4  # N instead of each layer's own count
    else:
        assert checks["off"]["error"] <= TOL, checks["off"]["error"]
    assert_mtp_exact(checks, 2, "one rank", modes=("token_mean", "sequence_mean"))


ZERO_TOKEN = {
    # DP rank 0 of DP2 x CP2 holds no loss token: both its CP ranks and all its micro-batches.
    "dp2xcp2-empty-rank": (Layout(cp=2), 4, {"no_attention": True}, range(12)),
    # The first of three micro-batches is empty as it passes through both pipeline stages.
    "pp2-empty-microbatch": (Layout(pp=2), 2, ROPE, range(8)),
}


@pytest.mark.parametrize("name", list(ZERO_TOKEN))
def test_zero_tokens_with_moe_and_mtp(dist_pool, name):
    """MoE and 2 MTP layers with no loss token on a whole rank or in a micro-batch: exact,
    finite, no hang."""
    layout, world, model_kwargs, zero = ZERO_TOKEN[name]
    case = OracleCase(
        model_kwargs={**model_kwargs, "num_experts": 4, "mtp_num_layers": 2},
        zero_sequences=zero,
    )
    checks = check_layout(dist_pool, case, layout, world, 3, ("token_mean", "sequence_mean"))
    for mode, check in checks.items():
        grads = check["result"]["grads"]
        assert all(torch.isfinite(g).all() for g in grads.values()), mode
    assert_mtp_exact(checks, 2, name, modes=tuple(checks))
