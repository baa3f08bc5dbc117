"""Megatron-LM: our patch of its ``pretrain_gpt.py``, ``training.py`` and ``train_rl.py``.

* ``training``: what the patched ``pretrain_gpt.py`` and ``training.py`` call (its names are
  served at this package's address, which the patches import); ``batches`` and ``metrics``: the
  loss stage's batches and ``--lossfix-metrics-out`` under Megatron-LM; ``cpu``: its training
  loop on a machine without CUDA; ``patches``: apply, check and revert the diffs.
* ``rl``: what the patched ``train_rl.py`` calls; ``rl_groups``: the GRPO group of each row;
  the RL replay (``python -m megatron_lossfix rl-replay``): ``rl_replay``, ``rl_plans``,
  ``rl_records``, ``rl_compare``; ``tiny_gpt``: the tiny GPT Megatron-LM trains on CPU.
"""

from megatron_lossfix.integrations import serve

__getattr__ = serve(__name__, "training")
