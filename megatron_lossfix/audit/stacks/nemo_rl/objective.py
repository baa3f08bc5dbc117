"""``--stack nemo-rl``: the exact objective of each setting, by plain autograd on one rank.

The whole step's 12 rows go through the one-rank tiny GPT in one forward pass (no Megatron
schedule, no micro-batches); NeMo-RL's own loss input preparation and loss function then run
once over all of them, with the counts the plugin's modes define (``count_tokens`` over the
loss tokens ``token_mask[:, 1:] x sample_mask``): ``global_valid_toks`` = N (``token_mean``),
``global_valid_seqs`` = S, the sequences with a loss token (``sequence_mean``), or 2 P for DPO
(P the pairs with a loss token: NeMo-RL divides by ``global_valid_seqs / 2``). Over the whole
batch in one call, the VAPO NLL term's own count (the correct samples' loss tokens of the
call) is the step's.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_lossfix.audit.stacks.nemo_rl import batch as nb
from megatron_lossfix.runtime.weights import count_tokens

__all__ = ["exact_counts", "nemo_rl_reference"]


def exact_counts(setting: str, data: dict[str, torch.Tensor]) -> tuple[float, float]:
    """``(global_valid_seqs, global_valid_toks)`` of the exact objective (module docstring)."""
    mask = data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)
    counts = count_tokens([mask], global_counts=False)
    units = float(counts.num_sequences)
    if setting == "dpo":
        pairs = (counts.seq_tokens[0].view(-1, 2).sum(dim=1) > 0).sum()
        units = 2.0 * float(pairs)
    return units, float(counts.num_tokens)


def nemo_rl_reference(settings: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
    """The exact objective's full gradient of each setting (one rank, one forward pass)."""
    from megatron_lossfix.audit import tiny_gpt
    from megatron_lossfix.audit.stacks.nemo_rl.cpu import prepare_nemo_rl_imports
    from megatron_lossfix.audit.stacks.nemo_rl.ranks import tiny_gpt_kwargs

    prepare_nemo_rl_imports()
    from nemo_rl.algorithms.loss.utils import prepare_loss_input
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    tiny_gpt.init_layout(tiny_gpt.Layout())
    (model,), config = tiny_gpt.build_tiny_gpt(
        tiny_gpt.Layout(), calculate_per_token_loss=True, **tiny_gpt_kwargs()
    )
    out: dict[str, dict[str, torch.Tensor]] = {}
    for setting in settings:
        tiny_gpt.set_deterministic_params([model], seed=0)
        model.zero_grad_buffer()
        loss_fn = nb.loss_fn(setting)
        data: Any = BatchedDataDict(nb.step_batch(setting, config.vocab_size))
        logits = model(input_ids=data["input_ids"], position_ids=None, attention_mask=None)
        loss_input, data = prepare_loss_input(logits=logits, data=data, loss_fn=loss_fn)
        seqs, toks = exact_counts(setting, data)
        loss, _ = loss_fn(
            data=data,
            global_valid_seqs=torch.tensor(seqs),
            global_valid_toks=torch.tensor(toks),
            **loss_input,
        )
        loss.backward()
        model.finish_grad_sync()
        grads = tiny_gpt.gather_full_grads([model])
        assert grads is not None
        out[setting] = grads
    return out
