"""Kernel implementations per method: each wraps kvq_metal's kernels in the method's Encoded layout."""
