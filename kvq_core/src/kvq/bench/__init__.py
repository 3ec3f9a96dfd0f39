"""Benchmarks behind ``kvq bench`` and ``kvq autotune``: timing, memory and bandwidth measured on this device."""
