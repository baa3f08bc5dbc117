"""NeMo-RL: ``adapter`` (its Megatron policy worker under the plugin's counts, switched on by
``enable()``) and ``install`` (NeMo-RL from its sources); its names are served at this address.
"""

from megatron_lossfix.integrations import serve

__getattr__ = serve(__name__, "adapter")
