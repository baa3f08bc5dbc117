"""``--stack skyrl``: ``stack`` runs skyrl's own Megatron loss path, as released and through
:mod:`megatron_lossfix.integrations.skyrl.adapter`."""
