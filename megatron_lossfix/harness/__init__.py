"""Harnesses: Megatron-Core on a machine without a GPU (``cpu_megatron``), for the audit, the
tests and anyone who wants to run a Megatron step on CPU/gloo."""
