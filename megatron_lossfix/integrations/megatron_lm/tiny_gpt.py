"""A tiny GPT that Megatron-LM trains on CPU in seconds per step: its flags, and the EOD id of
the tokenizer they name in a given checkout.

One definition for every tiny run of a Megatron-LM checkout: the RL replay's ``train_rl.py``
flags (:func:`~megatron_lossfix.integrations.megatron_lm.rl_plans.rl_args`) and the tests'
``pretrain_gpt.py`` runs build on :func:`tiny_gpt_flags`.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["VOCAB_SIZE", "checkout_null_tokenizer_eod", "tiny_gpt_flags"]

#: ``--vocab-size`` of the runs. NullTokenizer's EOD id depends on it (and on the release:
#: :func:`checkout_null_tokenizer_eod`).
VOCAB_SIZE = 256


def tiny_gpt_flags(
    *,
    seq_length: int,
    micro_batch_size: int,
    global_batch_size: int,
    train_iters: int,
    lr: str,
) -> list[str]:
    """Flags of a tiny GPT (2 layers, hidden size 64, 4 heads, NullTokenizer of
    :data:`VOCAB_SIZE` ids, seed 1234) that Megatron-LM trains on CPU: local layers, CPU
    initialization, no fused kernels and no dropout, so that runs are comparable across
    layouts; logs every iteration and never evaluates."""
    return [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", str(seq_length), "--max-position-embeddings", str(seq_length),
        "--micro-batch-size", str(micro_batch_size),
        "--global-batch-size", str(global_batch_size),
        "--train-iters", str(train_iters), "--lr", lr, "--seed", "1234",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB_SIZE),
        "--transformer-impl", "local", "--use-cpu-initialization",
        "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
        "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
        "--no-rope-fusion", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
    ]  # fmt: skip


def checkout_null_tokenizer_eod(
    megatron_lm_path: str | os.PathLike, vocab_size: int = VOCAB_SIZE
) -> int:
    """NullTokenizer's EOD id for ``--vocab-size vocab_size`` in this checkout's own code.

    The installed megatron-core may be another release than the checkout (the id moved in
    0.18: 256 up to 0.17, 255 from 0.18 at :data:`VOCAB_SIZE`); this loads the checkout's
    ``null_tokenizer.py`` by itself (it imports nothing from Megatron), which costs nothing
    next to importing ``megatron.core``.
    """
    import importlib.util

    source = Path(megatron_lm_path) / "megatron/core/tokenizers/text/libraries/null_tokenizer.py"
    spec = importlib.util.spec_from_file_location("_lossfix_checkout_null_tokenizer", source)
    if spec is None or spec.loader is None or not source.is_file():
        raise FileNotFoundError(
            f"{source} not found: is {megatron_lm_path} a Megatron-LM checkout?"
        )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return int(module.NullTokenizer(vocab_size).eod)
