"""make gpu-check: the GPU path proven in one command within a budget (default 320 s: under a `timeout 340`), every
figure it rests on written as it goes, flat, so that a kill keeps what was found and a reader can check each verdict.

It prints its plan first (each step with its expected seconds; the steps within the budget sum to no more than it),
then runs the steps in order of value:
1. the core run: SD 1.5 at 512 and SDXL base at 1024 (their native sizes), fp16, with naive, sdpa as PyTorch picks
   and each SDPA kernel forced (flash, efficient, cuDNN, math), through worker subprocesses, each cell recorded the
   moment it ends;
2. judged on its cells: every cell ok within the fp16 tolerance of an fp32 reference; each forced kernel ran that
   kernel (named from its GPU kernels); each forward peak within 5% of the planner's; sdpa ran the kernel PyTorch
   answers (and where the planner's no-GPU rule differs); naive's per-call peak within 5% of its memory model; each
   call's event time against its kernels' GPU time in the same pass; NVML's process memory over the allocator's; the
   allocator holding only the model and its forward;
3. the harness: builds on CUDA (random, and a saved folder), CUDA-event time against a synchronized wall clock,
   kernels credited to the call that launched them, a provoked OOM then a cell that runs, a sweep's parent that holds
   no CUDA context, cuda:1 where there is one;
4. the rest: the chunked backends (sliced, split, subquad; xformers and flash-attn where installed) at the same sizes,
   judged the same way; then flex, sage and FlashAttention 3 where installed.
Every step that runs a model runs in a child process of its own (its own process group, faulthandler on); the main
process never makes a CUDA context. As steps end the estimates are scaled by what they took, and a step that no
longer fits in the budget SKIPs with that reason; SIGTERM, SIGINT or the budget's end stop the step in flight (its
process group killed, a stopped run tabulated with the cells it finished) and the report says where it stopped.

At the top of --out (default results/gpu-check-<time>), five files: report.md, cells.csv, blocks.csv,
gpu-check.log and device.txt; the runs go under --runs (default OUT/runs). On a GPU, docs/gpu-validation.md's record
table gets a row linking the report. On a machine without CUDA it says so in one line and exits 0, writing nothing;
where NVML sees a GPU but torch has no CUDA it says so in one line and exits 1. `--device cpu` runs the same flow on
the CPU to try the script (the steps that need CUDA SKIP); `--dry-run` prints the plan and exits.
"""
from .checks import own_gpu_kernels  # noqa: F401
from .plan import STEPS, Step  # noqa: F401
from .verdicts import Context, Skip, Verdict  # noqa: F401
from .runner import main  # noqa: F401
