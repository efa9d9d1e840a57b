"""The machine's state, read between forwards and never by a thread while anything is timed: what the host pays a
launch, how fast the device runs a fixed GEMM, the GPU's clocks, the host's steal time and clock. A cell's state is
read before and after it; a cell where the host or the GPU moved over UNSTEADY_SHARE is `unsteady` and not ranked
(report/findings.py), since its backends' differences may be the machine's.

- launch_us(dev): host microseconds per launch of a tiny op (LAUNCH_OPS in-place adds to a one-element tensor, the
  device synchronized before and after, outside the clock), the median of LAUNCH_ROUNDS rounds: on CUDA what the host
  pays to dispatch and launch one op (the GPU runs each in a few microseconds, so the host sets the pace); on the CPU
  what it pays to dispatch and run one. The host's own speed, which moved 1.4-2x within minutes on the H200's VM.
- gemm_ref_ms(dev): a fixed GEMM on the device (CUDA: 4096 x 4096 fp16, GEMM_REPLAYS products replayed from one CUDA
  graph, timed by events around the replay: no host in the figure; the CPU: 256 x 256 fp32 by the host clock), the
  median of GEMM_ROUNDS rounds per product: the device's own speed.
"""
from __future__ import annotations

import statistics
import time

import torch

from .. import devices

LAUNCH_OPS = 1000
LAUNCH_ROUNDS = 5
GEMM_REPLAYS = 20
GEMM_ROUNDS = 5
UNSTEADY_SHARE = 0.05  # a figure read before and after a cell that moved more than this: the cell is unsteady


def launch_us(device, ops: int = LAUNCH_OPS, rounds: int = LAUNCH_ROUNDS, clock=time.perf_counter) -> float:
    """Host microseconds per launch of a tiny op on the device (module docstring)."""
    dev = devices.get(device) if isinstance(device, (str, torch.device)) else device
    with dev.guard(), torch.no_grad():
        x = torch.zeros(1, device=dev.torch)
        for _ in range(ops // 10):  # warm: the op's first dispatch, the device's first launch
            x.add_(1.0)
        samples = []
        for _ in range(rounds):
            dev.synchronize()
            t0 = clock()
            for _ in range(ops):
                x.add_(1.0)
            samples.append((clock() - t0) / ops * 1e6)
            dev.synchronize()
    return statistics.median(samples)


def gemm_ref_ms(device, rounds: int = GEMM_ROUNDS) -> float:
    """Milliseconds per product of a fixed GEMM on the device (module docstring): the device's own speed, replayed
    from a CUDA graph on a GPU (devices.Cuda.replay_ms), by the host clock on the CPU."""
    dev = devices.get(device) if isinstance(device, (str, torch.device)) else device
    cuda = dev.torch.type == "cuda"
    n, dtype = (4096, torch.float16) if cuda else (256, torch.float32)
    with dev.guard(), torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        a, b = (torch.randn(n, n, generator=gen).to(device=dev.torch, dtype=dtype) for _ in range(2))
        out = torch.empty(n, n, device=dev.torch, dtype=dtype)
        samples = dev.replay_ms(lambda: torch.mm(a, b, out=out), GEMM_REPLAYS, rounds)
    return statistics.median(samples)
