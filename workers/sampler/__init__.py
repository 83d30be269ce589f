"""Sampling: the torch and vLLM backends, the sampler service and its guard."""
