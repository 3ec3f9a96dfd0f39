"""Kernel implementations of kvq core's baseline methods (:mod:`kvq.baselines`).

Why here: a method's kernels belong in its plugin, which depends on kvq_metal; but the baselines live in kvq core,
below kvq_metal (kvq core <- kvq_metal <- method plugins), so their kernel implementations cannot sit with them.
They are the only method-specific code in kvq_metal, registered by kvq_metal's entry point.
"""
