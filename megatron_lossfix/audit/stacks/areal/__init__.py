"""``--stack areal``: ``stack`` runs AReaL's own Megatron training step, as released and through
:mod:`megatron_lossfix.integrations.areal`; ``batch`` (the step's data and AReaL's settings),
``ranks`` (what each rank runs), ``objective`` (the exact objective of each setting, on one rank).
"""
