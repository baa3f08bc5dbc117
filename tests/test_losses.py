"""megatron_lossfix.runtime.losses vs plain-PyTorch references written beside them.

The references loop over elements in fp64 and share no code with the module: ``weighted_sum`` is
``sum(w * l)`` over the tokens with a non-zero weight (whatever the others hold), and
``weighted_loss`` is Megatron's 3-tuple around it. Odd shapes, three dtypes, values and
gradients.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_lossfix.runtime.losses import weighted_loss, weighted_sum

pytestmark = pytest.mark.unit

SHAPES = [(1, 1), (3, 7), (5, 13), (2, 1)]
DTYPES = [torch.float32, torch.bfloat16, torch.float64]


def ref_weighted_sum(per_token: torch.Tensor, weights: torch.Tensor) -> float:
    """sum over tokens with w != 0 of w * l, element by element, in fp64."""
    total = 0.0
    rows, cols = per_token.shape
    for i in range(rows):
        for j in range(cols):
            w = float(weights[i, j])
            if w != 0.0:
                total += w * float(per_token[i, j])
    return total


def ref_grad(weights: torch.Tensor) -> torch.Tensor:
    """d(sum w * l)/dl: the weight where it is non-zero, exactly 0 elsewhere."""
    rows, cols = weights.shape
    out = torch.zeros(rows, cols, dtype=torch.float64)
    for i in range(rows):
        for j in range(cols):
            out[i, j] = float(weights[i, j])
    return out


def make(shape, dtype, seed, garbage=True):
    """Per-token losses, weights with some zero (masked) tokens, garbage on the masked ones."""
    gen = torch.Generator().manual_seed(seed)
    per_token = (torch.rand(shape, generator=gen, dtype=torch.float64) * 5).to(dtype)
    mask = torch.rand(shape, generator=gen) < 0.6
    mask.view(-1)[0] = True  # at least one loss token
    weights = torch.where(mask, torch.rand(shape, generator=gen) + 0.1, torch.zeros(shape))
    if garbage and not mask.all():
        # Padding may hold anything: NaN, +-Inf. None of it may reach the value or the gradient.
        junk = torch.tensor([math.nan, math.inf, -math.inf], dtype=dtype)
        idx = torch.nonzero(~mask.view(-1)).squeeze(1)
        per_token.view(-1)[idx] = junk[torch.arange(idx.numel()) % 3]
    return per_token, weights


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_weighted_sum_matches_reference(shape, dtype):
    per_token, weights = make(shape, dtype, seed=sum(shape))
    x = per_token.clone().requires_grad_(True)
    value = weighted_sum(x, weights)
    assert value.dtype == torch.float32 and value.dim() == 0
    want = ref_weighted_sum(per_token, weights)
    assert math.isfinite(value.item())
    assert value.item() == pytest.approx(want, rel=1e-6, abs=1e-6)
    (grad,) = torch.autograd.grad(value, x)
    assert grad.dtype == dtype and torch.isfinite(grad).all()
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6  # the gradient comes back in the input dtype
    torch.testing.assert_close(grad.double(), ref_grad(weights), rtol=tol, atol=tol)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_weighted_sum_with_a_mask_as_weights_is_the_masked_token_sum(shape):
    """Stock Megatron-LM's loss ``sum(mask * l)``: the weights may be the 0/1 or bool mask."""
    per_token, weights = make(shape, torch.float32, seed=7, garbage=False)
    mask = weights != 0
    want = sum(float(per_token[i, j]) for i, j in torch.nonzero(mask).tolist())
    assert float(weighted_sum(per_token, mask.float())) == pytest.approx(want, rel=1e-6)
    assert float(weighted_sum(per_token, mask)) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_weighted_sum_of_a_micro_batch_without_loss_tokens_is_zero(shape):
    per_token = torch.full(shape, math.nan, requires_grad=True)
    value = weighted_sum(per_token, torch.zeros(shape))
    assert value.item() == 0.0
    (grad,) = torch.autograd.grad(value, per_token)
    assert torch.equal(grad, torch.zeros(shape))


@pytest.mark.parametrize(
    "loss_shape, weight_shape", [((2, 5), (2, 4)), ((3, 7), (7, 3)), ((4,), (1, 4))]
)
def test_weighted_sum_refuses_mismatched_shapes(loss_shape, weight_shape):
    with pytest.raises(ValueError, match="same micro-batch"):
        weighted_sum(torch.zeros(loss_shape), torch.zeros(weight_shape))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_weighted_loss_is_megatrons_three_tuple(shape, dtype):
    per_token, weights = make(shape, dtype, seed=3 * sum(shape))
    x = per_token.clone().requires_grad_(True)
    # Megatron calls loss_func(output_tensor) and, in some releases, extra keywords.
    loss, num_tokens, report = weighted_loss(weights, x, model=None)
    assert loss.item() == pytest.approx(ref_weighted_sum(per_token, weights), rel=1e-6, abs=1e-6)
    want_tokens = sum(1 for w in weights.view(-1).tolist() if w != 0.0)
    assert num_tokens.dtype == torch.int32 and num_tokens.dim() == 0
    assert int(num_tokens) == want_tokens
    assert report == {}
    (grad,) = torch.autograd.grad(loss, x)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(grad.double(), ref_grad(weights), rtol=tol, atol=tol)
