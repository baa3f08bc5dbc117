"""slime: ``adapter`` (its ``loss_function`` under the plugin's weights, switched on by
``--custom-megatron-init-path megatron_lossfix.integrations.slime.adapter.enable``); its names are
served at this address.
"""

from megatron_lossfix.integrations import serve

__getattr__ = serve(__name__, "adapter")
