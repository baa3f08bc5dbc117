"""``--stack ms-swift``: ms-swift's Megatron trainers under the audit's layouts (``stack``)."""
