"""Fused, chunked, vocab-parallel target log-probabilities and softmax entropy.

RL losses need two things from the LM head's logits: the log-probability of the sampled token and
the entropy of the full next-token distribution. Computing both with ``log_softmax`` materializes
several full-vocabulary fp32 copies of the logits (log-probs, probs, their product, and as many
again in autograd's backward) -- at 152k vocabulary that is several GB per micro-batch.

:func:`vocab_parallel_logprobs_entropy` computes both in one ``torch.autograd.Function``:

* forward walks the tokens in chunks of ``chunk_size`` rows; per chunk it needs one fp32 buffer of
  ``chunk_size x V_local`` and keeps only three fp32 numbers per token for backward;
* backward recomputes the softmax chunk by chunk and writes the gradient of *both* outputs
  (``d logp/dz = onehot - p``, ``dH/dz_j = -p_j (z_j - sum_i p_i z_i)``) straight into the one
  gradient tensor, with one fp32 chunk buffer;
* with tensor parallelism (Megatron layout: rank ``r`` holds vocabulary
  ``[r * V_local, (r + 1) * V_local)``) the row max, the sum of ``exp``, the sum of ``p * z`` and
  the target logit are all-reduced over ``tp_group``; backward needs no communication because every
  TP rank receives the same output gradients and owns its own slice of ``d logits``.

Peak extra memory is therefore about one fp32 chunk (``chunk_size * V_local * 4`` bytes) plus
O(tokens) vectors, independent of the total token count. ``chunk_size`` counts tokens: choose it so
that one chunk is a small fraction of the logits (e.g. 256 for 2k tokens at 152k vocabulary).

:func:`naive_logprobs_entropy` is the plain-PyTorch reference (full ``log_softmax``), used by the
tests and the benchmark.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["naive_logprobs_entropy", "vocab_parallel_logprobs_entropy"]

#: Default chunk budget in elements: a 16 MiB fp32 scratch buffer, whatever the vocabulary.
CHUNK_ELEMENTS = 1 << 22

#: On CUDA the default chunk may grow to this fraction of the logits' bytes: each chunk costs a
#: few dozen kernel launches and Python dispatches, so 16 MiB chunks (27 rows at 152k vocab)
#: would make the kernel launch-bound and slower than ``log_softmax``; 1/8 keeps the extra
#: memory at about 12.5% of the logits with at most a few dozen chunks.
CUDA_CHUNK_FRACTION = 8


def _tp_size(group: dist.ProcessGroup | None) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _chunk_stats(
    z: torch.Tensor,
    local_idx: torch.Tensor,
    in_range: torch.Tensor,
    scratch: torch.Tensor,
    acc: torch.dtype,
    tp_group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, ...]:
    """Per token of one chunk of logits ``z``: the row max m and, over the whole (TP-reduced)
    vocabulary, sum exp(z - m), sum exp(z - m) (z - m) and the target's z - m (0 off this rank)."""
    m = z.amax(dim=-1).to(acc)
    if tp_group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    # The single fp32 chunk buffer: x = z - m, then e = exp(x), then e * x. Using
    # e * log(e) == e * x lets us reuse the buffer instead of keeping x and e side by side;
    # underflowed e == 0 gives 0 through xlogy, which is the exact limit.
    buf = torch.sub(z, m[:, None], out=scratch[: z.shape[0]])
    buf.exp_()
    sum_e = buf.sum(dim=-1)
    buf.xlogy_(buf)
    sum_ex = buf.sum(dim=-1)
    x_t = z.gather(-1, local_idx[:, None]).squeeze(-1).to(acc) - m
    x_t = torch.where(in_range, x_t, torch.zeros_like(x_t))
    if tp_group is not None:
        stats = torch.stack([sum_e, sum_ex, x_t])
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=tp_group)
        sum_e, sum_ex, x_t = stats.unbind(0)
    return m, sum_e, sum_ex, x_t


class _LogprobsEntropy(torch.autograd.Function):
    """Target log-prob and entropy of softmax(logits) over a (possibly TP-sharded) vocabulary."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        logits: torch.Tensor,
        target: torch.Tensor,
        tp_group: dist.ProcessGroup | None,
        chunk_size: int,
        vocab_start: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out_shape = target.shape
        vocab = logits.shape[-1]
        z2d = logits.reshape(-1, vocab)
        tgt = target.reshape(-1)
        n_tok = z2d.shape[0]
        distributed = _tp_size(tp_group) > 1

        # Targets of other TP ranks (and out-of-vocabulary ids such as -100 on masked tokens) give
        # a zero local target logit; the clamp only keeps gather in bounds.
        local = tgt - vocab_start
        in_range = (local >= 0) & (local < vocab)
        local_idx = local.clamp(0, vocab - 1)

        # fp32 accumulation for bf16/fp16/fp32 logits; fp64 stays fp64 (useful for gradcheck).
        acc = torch.promote_types(logits.dtype, torch.float32)
        # Per token we keep m (row max), log S (S = sum exp(z - m)) and E_p[z - m]: everything is
        # kept relative to m, because log Z = m + log S rounded to fp32 loses ~ulp(|z|) absolutely
        # and large logits would then make p (and dH/dz) visibly inaccurate.
        row_max = torch.empty(n_tok, dtype=acc, device=logits.device)
        log_s = torch.empty_like(row_max)
        mean_x = torch.empty_like(row_max)
        logp = torch.empty_like(row_max)
        entropy = torch.empty_like(row_max)

        # One scratch buffer for all chunks: a fresh allocation per chunk costs page faults
        # (CPU) or allocator churn (GPU) on every chunk.
        scratch = torch.empty(min(chunk_size, n_tok), vocab, dtype=acc, device=logits.device)
        for start in range(0, n_tok, chunk_size):
            sl = slice(start, min(start + chunk_size, n_tok))
            m, sum_e, sum_ex, x_t = _chunk_stats(
                z2d[sl],
                local_idx[sl],
                in_range[sl],
                scratch,
                acc,
                tp_group if distributed else None,
            )
            row_max[sl] = m
            log_s[sl] = sum_e.log()
            mean_x[sl] = sum_ex / sum_e
            logp[sl] = x_t - log_s[sl]
            # H = -sum p log p = log Z - E_p[z] = log S - E_p[z - m].
            entropy[sl] = log_s[sl] - mean_x[sl]

        ctx.save_for_backward(logits, local_idx, in_range, row_max, log_s, mean_x, logp)
        ctx.chunk_size = chunk_size
        return logp.reshape(out_shape), entropy.reshape(out_shape)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx, grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, None, None, None, None]:
        logits, local_idx, in_range, row_max, log_s, mean_x, logp = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        vocab = logits.shape[-1]
        z2d = logits.reshape(-1, vocab)
        n_tok = z2d.shape[0]
        g_l = _flat_grad(grad_logp, n_tok, logp)
        g_h = _flat_grad(grad_entropy, n_tok, logp)
        grad = torch.empty_like(z2d)
        chunk_size = ctx.chunk_size
        scratch = torch.empty(min(chunk_size, n_tok), vocab, dtype=logp.dtype, device=grad.device)
        for start in range(0, n_tok, chunk_size):
            sl = slice(start, min(start + chunk_size, n_tok))
            z = z2d[sl]
            gc = grad[sl]
            gl = g_l[sl, None]
            gh = g_h[sl, None]
            # With x = z - m and p = exp(x - log S):
            # d/dz_j [gl*logp + gh*H] = gl*(onehot_j - p_j) - gh*p_j*(x_j - E_p x)
            #                         = p_j * (gh*(E_p x - x_j) - gl) + gl*onehot_j.
            # x lives in the one fp32 buffer; the bracket goes straight into the gradient tensor
            # (one fused addcmul); then the buffer turns into p in place.
            x = torch.sub(z, row_max[sl, None], out=scratch[: z.shape[0]])
            torch.addcmul(gh * mean_x[sl, None] - gl, x, -gh, out=gc)
            gc.mul_(x.sub_(log_s[sl, None]).exp_())
            # The target entry is recomputed in fp32 from per-token scalars: 1 - p_t cancels badly
            # when p_t -> 1, and -expm1(logp) does not (this matters most for bf16 logits).
            lp = logp[sl]
            idx = local_idx[sl, None]
            x_t = z.gather(-1, idx).squeeze(-1).to(lp.dtype) - row_max[sl]
            g_t = g_l[sl] * -torch.expm1(lp) - g_h[sl] * lp.exp() * (x_t - mean_x[sl])
            keep = gc.gather(-1, idx).squeeze(-1)
            new_t = torch.where(in_range[sl], g_t.to(gc.dtype), keep)
            gc.scatter_(-1, idx, new_t[:, None])

        del scratch
        return grad.reshape(logits.shape), None, None, None, None


def _flat_grad(g: torch.Tensor | None, n_tok: int, like: torch.Tensor) -> torch.Tensor:
    # An unused output arrives as None; treating it as zeros keeps one code path.
    if g is None:
        return torch.zeros(n_tok, dtype=like.dtype, device=like.device)
    return g.reshape(-1).to(like.dtype)


def vocab_parallel_logprobs_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    vocab_start_index: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of ``target`` and entropy of the full softmax, fused and chunked.

    Args:
        logits: ``[..., V_local]`` logits (fp32 or bf16; accumulation is fp32), this rank's slice of
            the vocabulary when ``tp_group`` has more than one rank.
        target: ``[...]`` global token ids. Ids outside the global vocabulary (e.g. ``-100`` on
            masked positions) give a finite but meaningless log-prob: mask them in the loss.
        tp_group: tensor-parallel group the vocabulary is split over; ``None`` means unsplit.
        chunk_size: tokens per chunk; peak extra memory is about ``chunk_size * V_local * 4``
            bytes. Default: as many tokens as fit ``CHUNK_ELEMENTS`` fp32 values (16 MiB),
            small next to any logits tensor and cache-friendly on CPU; on CUDA at least enough
            tokens for a scratch buffer of 1/``CUDA_CHUNK_FRACTION`` of the logits' bytes.
        vocab_start_index: first global id held by this rank; defaults to
            ``tp_rank * V_local`` (Megatron's layout), or 0 without ``tp_group``.

    Returns:
        ``(logprobs, entropy)``, fp32 (fp64 for fp64 logits), shaped like ``target``, both
        differentiable w.r.t. ``logits``.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} must be target {tuple(target.shape)} plus a vocab dim"
        )
    if chunk_size is None:
        chunk_size = max(1, CHUNK_ELEMENTS // max(1, logits.shape[-1]))
        if logits.is_cuda:
            # fp32 scratch of chunk_size rows <= logits bytes / CUDA_CHUNK_FRACTION.
            n_tok = logits.numel() // max(1, logits.shape[-1])
            rows = n_tok * logits.element_size() // (4 * CUDA_CHUNK_FRACTION)
            chunk_size = max(chunk_size, rows)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(f"logits must be a floating tensor, got {logits.dtype}")
    if vocab_start_index is None:
        vocab_start_index = 0
        if _tp_size(tp_group) > 1:
            vocab_start_index = dist.get_rank(tp_group) * logits.shape[-1]
    # A non-contiguous view would make reshape copy silently inside the Function; make the one
    # unavoidable copy explicit here instead.
    if not logits.is_contiguous():
        logits = logits.contiguous()
    return _LogprobsEntropy.apply(logits, target, tp_group, chunk_size, vocab_start_index)


def naive_logprobs_entropy(
    logits: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: full fp32 ``log_softmax`` over an unsplit vocabulary, then gather and entropy.

    Computes in fp32 (fp64 for fp64 logits); materializes several full-vocabulary copies.
    """
    acc = torch.promote_types(logits.dtype, torch.float32)
    logp_all = torch.log_softmax(logits.to(acc), dim=-1)
    logp = logp_all.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(dim=-1)
    return logp, entropy
