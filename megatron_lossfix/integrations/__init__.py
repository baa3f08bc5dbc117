"""Integrations with Megatron's training loops: Megatron-LM (``megatron_lm``, the patch tool
``patches``, ``cpu_megatron_lm``) and Megatron Bridge (``bridge``, ``cpu_megatron_bridge``).

Built on the runtime (the package's top level); imported by module name, never by
``import megatron_lossfix``, because these modules import Megatron-LM or Bridge.
"""
