"""``--stack slime``: ``stack`` runs slime's own Megatron loss path, as released and through
:mod:`megatron_lossfix.integrations.slime`; ``batch`` (the step's data and slime's settings),
``ranks`` (what each rank runs), ``objective`` (the exact objectives and slime's one-rank result).
"""
