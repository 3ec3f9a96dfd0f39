"""Cost model for selection: launch overhead + bytes moved / bandwidth + flops / throughput.

The constants per device kind are rough defaults; ``kvq autotune`` replaces them with measured crossovers
(stored under platformdirs' user cache dir). Estimates are in seconds.
"""

from __future__ import annotations

import attrs

from .problem import Problem


@attrs.frozen
class DeviceProfile:
    """Throughput constants of one device kind.

    :param launch_s: seconds of fixed overhead per kernel dispatch / MLX op.
    :param bandwidth: bytes per second of device memory traffic.
    :param flops: float operations per second.
    """

    launch_s: float
    bandwidth: float
    flops: float


#: Defaults: Apple GPU dispatch overhead of ~0.17 ms is the seed blog's measurement; H200 bandwidth is
#: REFERENCE_VALUES.md's measured elementwise 3.46 TB/s; the CPU numbers are a 2-core Linux machine.
PROFILES = {
    "cpu": DeviceProfile(launch_s=5e-6, bandwidth=10e9, flops=20e9),
    "metal": DeviceProfile(launch_s=1.7e-4, bandwidth=200e9, flops=5e12),
    "cuda": DeviceProfile(launch_s=1e-5, bandwidth=3.46e12, flops=50e12),
}


def estimate(problem: Problem, *, launches: int, bytes_moved: float, flops: float) -> float:
    """Seconds for a computation of ``launches`` dispatches moving ``bytes_moved`` and doing ``flops``."""
    p = PROFILES[problem.device]
    return launches * p.launch_s + bytes_moved / p.bandwidth + flops / p.flops
