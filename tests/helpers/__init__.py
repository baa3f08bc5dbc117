"""Test-only helpers: our LoRA layer, the refusal cases, the launcher that runs a script on N ranks
as torchrun does with its imports paid once (``launch``), Megatron-LM runs, and the pytest plugin
that swaps the plugin into Megatron-Core's own schedule tests. Imported as ``helpers.*`` (pytest
puts ``tests/`` on ``sys.path``)."""
