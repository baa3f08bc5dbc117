"""RL objectives on the runtime's weights: the objective (``objective``), the policy losses
(``policy_losses``) and the vocabulary-parallel log-prob kernel (``logprobs``).

The entry points users need are exported at the package's top level.
"""
