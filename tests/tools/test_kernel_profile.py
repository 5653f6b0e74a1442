"""glm53/support/kernel_profile.py on a recorded profile's averages: only CUDA kernels count, per
step, and a kernel is short by its mean time per call."""

from __future__ import annotations

import torch

from glm53.support.kernel_profile import kernel_table, launch_counts

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


class Avg:
    def __init__(self, key: str, us: float, count: int, device=CUDA):
        self.key, self.device_time_total, self.count, self.device_type = key, us, count, device


class Prof:
    def key_averages(self):
        return [Avg("gemm", 100.0, 10), Avg("norm", 6.0, 3), Avg("host op", 50.0, 2, CPU), Avg("idle", 0.0, 4)]


def test_table_and_counts_per_step():
    total, rows = kernel_table(Prof(), steps=2, top=1)
    assert total == 53.0 and rows == [{"name": "gemm", "us_per_step": 50.0, "calls_per_step": 5.0}]
    # gemm averages 10 µs a call (not short); norm 2 µs
    assert launch_counts(Prof(), steps=2) == {"kernels_per_step": 6.5, "under_8us_per_step": 1.5,
                                              "under_8us_time_us": 3.0}
    assert launch_counts(Prof(), steps=1, short_us=12)["under_12us_per_step"] == 13
