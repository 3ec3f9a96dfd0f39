"""kvq fused kernels for Metal and CUDA through MLX custom kernels (skeleton: kernels land with their issue)."""


def kvq_register(register):
    """Entry point ``metal``: registers nothing yet."""
