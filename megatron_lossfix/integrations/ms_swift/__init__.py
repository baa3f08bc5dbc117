"""ms-swift: ``adapter`` (its Megatron trainers' steps with the plugin's weights; the switch is
``enable``); its names are served at this address. ``cpu`` lets ms-swift's Megatron trainers be
imported where Transformer Engine is not installed. The stack audit that runs ms-swift's own
steps stands in ``megatron_lossfix.audit.stacks.ms_swift``; docs/ms_swift.md says how to install
and run both.
"""

from megatron_lossfix.integrations import serve

__getattr__ = serve(__name__, "adapter")
