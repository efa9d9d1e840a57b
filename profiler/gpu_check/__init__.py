"""make gpu-check: the GPU path proven in one command, within a budget (default 420 s, under 8 minutes on one
H200-class GPU), its report written as each check ends so that a kill keeps what was found.

It prints its plan first (each check with its expected seconds), then runs the checks in order of value:
1. core: random and folder builds on cuda; SD 1.5 at 512 and 1024 with naive and every SDPA kernel (one cell per
   kernel, each call's GPU kernel the forced one; naive's per-call peak against its memory model; the forward peak
   against the planner; each call's event time against its kernels' GPU time; NVML against the allocator); CUDA-event
   time against a synchronized wall clock; kernels credited to the call that launched them; a provoked OOM followed
   by a cell that runs; a sweep's parent that holds no CUDA context; cuda:1 where there is one;
2. SDXL base at 1024: the forward peak against the planner, a GPU kernel on every call;
3. the reduced default sweep (configs/sweeps/default.yaml at 512 and 1024 through workers, without the backends of
   4): every ok cell's forward peak within 5% of the planner's, the SDPA kernel PyTorch ran against the one it
   answers (and the planner's no-GPU rule beside), the allocator holding only the model and its forward;
4. flex, sage and FlashAttention 3 (diffusers:_flash_3), where installed: each call's GPU kernels its own.
A check that would not fit in what is left of the budget SKIPs with that reason; SIGTERM, SIGINT or the budget's
end stop the check in flight and the report says "stopped after N of M checks".

Everything goes under --out (default results/gpu-check-<time>): gpu-validation.md, gpu-check.log, runs/ (with each
run's worker.log), nvidia-smi-q.txt, torch-config.txt. On a GPU, docs/gpu-validation.md's record table gets a row
linking the report. On a machine without CUDA it says so in one line and exits 0, writing nothing; where NVML sees a
GPU but torch has no CUDA it says so in one line and exits 1. `--device cpu` runs the same flow on the CPU to try the
script (the checks that need CUDA SKIP; those on the sweep's cells run on the CPU's cells).
"""
from .checks import CHECKS, Context, Planned, SharedRunFailed, Skip, own_gpu_kernels, title  # noqa: F401
from .runner import main  # noqa: F401
