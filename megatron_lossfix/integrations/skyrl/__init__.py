"""SkyRL: ``adapter`` (its Megatron model wrapper with the plugin's schedule and weights); its
names are served at this address.
"""

from megatron_lossfix.integrations import serve

__getattr__ = serve(__name__, "adapter")
