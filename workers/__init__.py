"""Trainer and sampler workers: the engine that runs tenants' LoRA passes on a shared base model."""
