"""``--stack verl``: ``stack`` runs verl's own Megatron loss path, as released and through
:mod:`megatron_lossfix.integrations.verl.adapter`."""
