"""The maths of a pass and a step: multi-slot LoRA and its kernels, passes and packing, losses,
custom losses, the optimizer and isolation. Imports neither `workers.trainer` nor
`workers.sampler`."""
