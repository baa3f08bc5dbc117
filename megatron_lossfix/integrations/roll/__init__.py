"""ROLL: ``adapter`` (its Megatron strategy's step with the plugin's weights; the switch is
``enable``); its names are served at this address. The stack audit that runs ROLL's own step
stands in ``megatron_lossfix.audit.stacks.roll``; docs/roll.md says how to install and run both.
"""

from megatron_lossfix.integrations import serve

__getattr__ = serve(__name__, "adapter")
