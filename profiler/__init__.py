"""attnprof: a profiler for the attention blocks of Stable Diffusion U-Nets."""
__version__ = "0.1.0"
