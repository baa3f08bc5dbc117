"""NeMo-RL: its own Megatron policy worker under the audit's layouts (``--stack nemo-rl``)."""
