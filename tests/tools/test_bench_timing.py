"""Timing and memory as the benchmarks take them (`hf_kvbridge.tools.bench.timing`)."""

import torch

from hf_kvbridge.tools.bench.timing import peak_extra_bytes


def test_peak_memory_sees_a_large_temporary():
    def allocate():
        big = torch.ones(4_000_000)  # 16 MB, freed before returning
        return float(big.sum())

    peak = peak_extra_bytes(allocate, torch.device("cpu"))
    assert peak is None or peak >= 15_000_000


def test_cpu_memory_records_print_no_profiler_noise(capfd):
    from hf_kvbridge.tools.bench.timing import cpu_peak_bytes

    assert cpu_peak_bytes(lambda: torch.ones(1000) * 2) >= 4000
    captured = capfd.readouterr()
    assert "USDT" not in captured.out + captured.err and "profiler_start" not in captured.out + captured.err
