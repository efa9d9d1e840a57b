"""The machine's own speed, at the start and at the end of every run (the manifest's `calibration`): a fixed small
workload timed as the cells are, so that attnprof diff can tell a machine that was busier (another process on the
CPU, a clock that throttled) from a change in what was measured.

The workload is attention-shaped, as the cells are: on fixed random Q, K, V of 8 heads x 512 tokens x 40 (float32;
float16 on CUDA), a naive attention whole (two batched matmuls and a softmax: the large operations) and then head by
head (24 small operations, whose cost is mostly the threads' handoff: what another process on the CPU slows most). One
round is that pair; ROUNDS rounds after one warm-up, each timed by the device's interval (a host clock on the CPU,
CUDA events on a GPU) after a synchronize, summarised by their median as a cell's times are. Each round draws its Q,
K, V anew: on this project's 2-core virtual machine one set of buffers ran the workload at 7-8 ms and another, of the
same shape, at 15-16 ms, call after call (where they lie in memory, not the machine's speed), so that a calibration on
one set read 2x apart from the next; over fresh buffers each round, 41 rounds' medians read within 5% of each other.
About 0.6 s on a 2-core CPU.

On CUDA the workload's 27 small launches are the host's time, not the GPU's (the first H200 run's calibrations read
"the machine moved 1.60x": its host): there the round is captured into a CUDA graph once and replayed ROUNDS times
(devices.Cuda.replay_ms), each replay timed by events: the GPU's own speed, as the cells' kernel times are."""
from __future__ import annotations

import statistics

ROUNDS = 41
SHAPE = (8, 512, 40)  # heads, tokens, head dim
WORKLOAD = (f"naive attention on {SHAPE[0]} heads x {SHAPE[1]} tokens x {SHAPE[2]}, whole then head by head; median "
            f"of {ROUNDS} rounds after one warm-up, fresh inputs each round")


def calibrate(device: str, when: str) -> dict:
    """{"when": start | end, "at", "median_ms", "samples_ms", "workload"}: one calibration on the device."""
    import torch

    from .. import devices
    from ..store import now

    dev = devices.get(device)
    gen = torch.Generator().manual_seed(0)
    dtype = torch.float16 if device.startswith("cuda") else torch.float32
    samples = []
    with torch.inference_mode(), dev.guard():
        if dev.kernel_clock:
            q, k, v = (torch.randn(SHAPE, generator=gen).to(device=device, dtype=dtype) for _ in range(3))
            samples = dev.replay_ms(lambda: one_round(q, k, v), 1, ROUNDS)
        for i in range(0 if dev.kernel_clock else ROUNDS + 1):
            q, k, v = (torch.randn(SHAPE, generator=gen).to(device=device, dtype=dtype) for _ in range(3))
            dev.synchronize()
            interval = dev.interval()
            interval.start()
            one_round(q, k, v)
            interval.stop()
            dev.synchronize()
            if i:  # the first is the warm-up
                samples.append(interval.ms())
    return {"when": when, "at": now(), "median_ms": statistics.median(samples), "samples_ms": samples,
            "workload": WORKLOAD}


def one_round(q, k, v) -> None:
    """One timed round of the workload: the attention whole, then head by head."""
    _attention(q, k, v)
    for h in range(SHAPE[0]):
        _attention(q[h], k[h], v[h])


def _attention(q, k, v):
    import torch

    return torch.softmax(q @ k.transpose(-1, -2) * SHAPE[2] ** -0.5, dim=-1) @ v
