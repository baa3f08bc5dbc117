"""Stock Megatron-Core runs on CPU/gloo: the bridge (`cpu_compat`) and harness (`testing`) work.

One training step of the real GPTModel through Megatron's own pipeline schedules, DDP and
`finalize_model_grads`, under several parallel layouts, must give the gradient of a 1-rank,
1-micro-batch reference (relative L2 <= 1e-5). The loss is the hand-normalized global token mean
that undoes Megatron's averaging (docs/design.md §1): `loss_sum * num_microbatches * dp /
N_global` as a 2-tuple. No lossfix plugin code is involved.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_lossfix.audit.pool import DistPool
from megatron_lossfix.audit.tiny_gpt import (
    Layout,
    build_tiny_gpt,
    gather_full_grads,
    init_layout,
    set_deterministic_params,
)

pytestmark = pytest.mark.oracle

SEED = 7
VOCAB = 264
SEQ_LEN = 16
# Tokens per sequence (2..16) and how many of them are an unsupervised prompt.
LENGTHS = [16, 3, 9, 16, 5, 12, 2, 7]
PROMPTS = [4, 0, 3, 0, 2, 5, 1, 0]
GLOBAL_BATCH = len(LENGTHS)

DENSE = {}
MOE = {"num_experts": 4}
NO_ATTENTION = {"no_attention": True}


def make_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deterministic global batch: (tokens, labels, loss_mask), each [GLOBAL_BATCH, SEQ_LEN]."""
    gen = torch.Generator().manual_seed(SEED)
    seqs = torch.randint(1, VOCAB, (GLOBAL_BATCH, SEQ_LEN + 1), generator=gen)
    pos = torch.arange(SEQ_LEN)
    lengths, prompts = torch.tensor(LENGTHS)[:, None], torch.tensor(PROMPTS)[:, None]
    real = pos < lengths
    tokens = torch.where(real, seqs[:, :-1], 0)
    labels = torch.where(real, seqs[:, 1:], 0)
    mask = (real & (pos >= prompts)).float()
    return tokens, labels, mask


def _train_step(
    layout: Layout, num_microbatches: int, model_kwargs: dict, stock_mean: bool = False
) -> dict | None:
    """One forward/backward step of Megatron's schedule; the full gradient on rank 0.

    `stock_mean`: return the micro-batch's own token mean instead, which Megatron then averages
    over micro-batches and DP ranks (the per-micro-batch mean this project fixes).
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    layout = init_layout(layout)
    chunks, _ = build_tiny_gpt(layout, vocab=VOCAB, seq_len=SEQ_LEN, **model_kwargs)
    set_deterministic_params(chunks, SEED)

    tokens, labels, mask = make_batch()
    n_global = mask.sum()
    positions = torch.arange(SEQ_LEN).expand(GLOBAL_BATCH, -1)
    # DP rank r takes the r-th contiguous slice; micro-batches are contiguous slices of that.
    per_rank = GLOBAL_BATCH // layout.dp
    mbs = per_rank // num_microbatches
    dp_rank = parallel_state.get_data_parallel_rank()
    # CP: contiguous sequence shards; exact only for models that mix nothing across tokens.
    cp_len = SEQ_LEN // layout.cp
    cols = slice(parallel_state.get_context_parallel_rank() * cp_len, None)
    micro = []
    for k in range(num_microbatches):
        rows = slice(dp_rank * per_rank + k * mbs, dp_rank * per_rank + (k + 1) * mbs)
        micro.append(tuple(t[rows, cols][:, :cp_len] for t in (tokens, labels, mask, positions)))

    def forward_step(data_iterator, model):
        tok, lab, msk, pos = next(data_iterator)
        output = model(tok, pos, None, labels=lab)

        def loss_func(per_token_loss):
            loss_sum = (per_token_loss.float() * msk).sum()
            if stock_mean:
                return loss_sum / msk.sum(), {"loss": loss_sum.detach()}
            return loss_sum * num_microbatches * layout.dp / n_global, {"loss": loss_sum.detach()}

        return output, loss_func

    for chunk in chunks:
        chunk.zero_grad_buffer()
    iterators = [iter(micro) for _ in chunks]
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if layout.vpp else iterators[0],
        model=chunks,
        num_microbatches=num_microbatches,
        seq_length=SEQ_LEN,
        micro_batch_size=mbs,
        forward_only=False,
    )
    return gather_full_grads(chunks)


def _references(variants: dict[str, dict]) -> dict[str, dict]:
    """1-rank, 1-micro-batch gradients of every model variant, in one pool run."""
    return {name: _train_step(Layout(), 1, kwargs) for name, kwargs in variants.items()}


def _fail_on_rank(rank: int) -> int:
    import torch.distributed as dist

    if dist.get_rank() == rank:
        raise ValueError(f"planned failure on rank {rank}")
    dist.barrier()  # the other ranks wait on the failed one: the failure must unblock them
    return dist.get_rank()


def _world_info(tag: str) -> tuple[str, int, int, bool]:
    import torch.distributed as dist

    from megatron_lossfix.harness.cpu_megatron import is_cpu_mode

    return tag, dist.get_rank(), dist.get_world_size(), is_cpu_mode()


def _rel_l2(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    assert got.keys() == ref.keys()
    for name in ref:
        assert got[name].shape == ref[name].shape, name
    diff = torch.cat([(got[n] - ref[n]).flatten() for n in ref])
    norm = torch.cat([ref[n].flatten() for n in ref])
    return (diff.norm() / norm.norm()).item()


@pytest.fixture(scope="module")
def references(dist_pool) -> dict[str, dict]:
    variants = {"dense": DENSE, "moe": MOE, "no_attention": NO_ATTENTION}
    return dist_pool.run(_references, 1, variants)[0]


def test_pool_runs_each_world_size(dist_pool):
    assert dist_pool.run(_world_info, 3, "x") == [("x", r, 3, True) for r in range(3)]
    assert [r[1:3] for r in dist_pool.run(_world_info, 8, "y")] == [(r, 8) for r in range(8)]


def test_pool_reraises_first_failure_fast(dist_pool):
    with pytest.raises(ValueError, match="planned failure on rank 2") as info:
        dist_pool.run(_fail_on_rank, 4, 2)
    assert "rank 2 of 4" in str(info.value.__cause__)
    # The pool survives a failed call.
    assert [r[1] for r in dist_pool.run(_world_info, 2, "z")] == [0, 1]


def test_reference_gradient_is_nonzero_everywhere(references):
    for variant, grads in references.items():
        for name, grad in grads.items():
            assert torch.isfinite(grad).all(), (variant, name)
            assert grad.abs().sum() > 0, (variant, name)


LAYOUTS = {
    "1rank_4mb": ("dense", Layout(dp=1), 4),
    "dp2": ("dense", Layout(dp=2), 2),
    "tp2": ("dense", Layout(tp=2, dp=1), 2),
    "pp2_1f1b": ("dense", Layout(pp=2, dp=1), 4),
    "pp2_interleaved": ("dense", Layout(pp=2, vpp=2, dp=1), 4),
    "tp2_pp2_dp2": ("dense", Layout(tp=2, pp=2, dp=2), 4),
    "ep2_moe": ("moe", Layout(dp=2, ep=2), 2),
    "cp2_no_attention": ("no_attention", Layout(cp=2, dp=1), 2),
}
_VARIANTS = {"dense": DENSE, "moe": MOE, "no_attention": NO_ATTENTION}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_layout_gradient_matches_reference(dist_pool, references, case):
    variant, layout, num_microbatches = LAYOUTS[case]
    grads = dist_pool.run(
        _train_step, layout.world_size, layout, num_microbatches, _VARIANTS[variant]
    )[0]
    assert _rel_l2(grads, references[variant]) <= 1e-5


def test_oracle_detects_per_micro_batch_mean(dist_pool, references):
    """Negative control: Megatron's stock mean of per-micro-batch means is not the global token
    mean when micro-batches hold different token counts, and the oracle sees it."""
    grads = dist_pool.run(_train_step, 2, Layout(dp=2), 2, DENSE, True)[0]
    assert _rel_l2(grads, references["dense"]) > 1e-2


def _moe_step(layout: Layout) -> None:
    _train_step(layout, 2, MOE)


def _threads() -> int:
    import os

    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread count needs Linux /proc")
def test_pool_workers_free_finished_moe_models(dist_pool):
    """A finished task leaves no process group behind. Megatron's MoE dispatcher keeps an
    autograd graph that ties the model into a cycle Python cannot collect; unless the pool frees
    it, each MoE task leaves its gloo groups (and their threads) in the worker: dozens per task,
    thousands over a suite."""
    dist_pool.run(_moe_step, 2, Layout(dp=2))  # warm: lazily started threads
    before = dist_pool.run(_threads, 2)
    for _ in range(2):
        dist_pool.run(_moe_step, 2, Layout(dp=2))
    after = dist_pool.run(_threads, 2)
    assert after == before, f"worker threads {before} -> {after} after two MoE tasks"


def _leave_a_failed_init_behind() -> None:
    """On rank 1, the state an `init_process_group` that failed mid-handshake leaves: no group,
    and torch's group counter one ahead of rank 0's."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if dist.get_rank() == 1:
        dist.destroy_process_group()
        distributed_c10d._world.group_count = 1


def _all_reduce_one() -> float:
    import torch.distributed as dist

    one = torch.ones(1)
    dist.all_reduce(one)
    return one.item()


def test_pool_recovers_from_a_failed_init_on_one_rank():
    """A rank whose process group failed to start must not name its later groups apart from
    its peers (each later task would wait under a store prefix nobody writes, and time out)."""
    with DistPool(max_ranks=2, timeout_s=20) as pool:
        pool.run(_leave_a_failed_init_behind, 2)
        assert pool.run(_all_reduce_one, 2) == [2.0, 2.0]


def _pid() -> int:
    return os.getpid()


def test_pool_tasks_without_collectives_do_not_race_the_handshake(dist_pool):
    """A task with no collective must not end, and close its rank's sockets, before every peer
    has finished connecting to it ("Gloo connectFullMesh failed ... Connection closed by peer"
    on the peer: about one run in 170 on 2 cores without the wait)."""
    for _ in range(300):
        dist_pool.run(_pid, 2)
