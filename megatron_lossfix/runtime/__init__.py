"""The runtime: the config, the table of modes, masks -> counts -> weights, the losses.

Plain PyTorch: nothing here imports Megatron, so an own training loop, a framework's loss code
and the unit tests use it without Megatron installed (docs/design.md §6).
"""
