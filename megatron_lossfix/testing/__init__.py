"""Test harness: Megatron-Core on CPU/gloo in a rank pool, a tiny GPT, and the gradient oracle."""
