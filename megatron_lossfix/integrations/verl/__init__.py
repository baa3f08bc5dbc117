"""verl: ``adapter`` (its Megatron step through the plugin's schedule, loaded by verl's
``verl.plugins`` entry point); its names are served at this address.
"""

from megatron_lossfix.integrations import serve

__getattr__ = serve(__name__, "adapter")
