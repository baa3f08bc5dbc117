"""What ``python -m megatron_lossfix audit`` needs: a rank pool (``pool``), the gradient oracle
(``oracle``, ``oracle_case``), the layout matrix (``matrix``), a tiny GPT (``tiny_gpt``, built
the Megatron-Core way by ``training`` with ``seeded_params``), and the command (``command``,
``options``, ``report``).
"""
