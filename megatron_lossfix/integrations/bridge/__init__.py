"""Megatron Bridge: ``adapter`` (the plugin's schedule in Bridge's training loop; its names
are served at this address), ``cpu`` (Bridge's loop on a machine without CUDA), ``install``
(``python -m megatron_lossfix install-bridge``, with ``requirements.txt``).
"""

from megatron_lossfix.integrations import serve

__getattr__ = serve(__name__, "adapter")
