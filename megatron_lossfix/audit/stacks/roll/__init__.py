"""``--stack roll``: ``stack`` runs ROLL's own Megatron training step, as released and through
:mod:`megatron_lossfix.integrations.roll`; ``batch`` (the step's data and ROLL's settings),
``ranks`` (what each rank runs), ``objective`` (the exact objective of each setting, on one rank).
"""
