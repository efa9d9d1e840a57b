"""Which kernel PyTorch's SDPA picks for an SD call (flash, mem-efficient, cuDNN or math): asked of PyTorch where
this process may ask (the CPU, or a CUDA device whose context it holds), else by PyTorch's documented priority and
checks on the target GPU (this machine's, or one assumed), so that asking never makes a CUDA context."""
from __future__ import annotations

import dataclasses
import os
import re

import torch

from .. import devices
from ..errors import InputError


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """The CUDA device whose SDPA choice the planner follows: this machine's GPU, or one assumed (--gpu-arch, or an
    H100-class sm90 where there is no GPU). cudnn: the cuDNN runtime's version number (91501 = 9.15.1)."""


    name: str
    capability: tuple[int, int]
    cudnn: int | None  # None: assumed 9.15 or newer (cuDNN preferred on sm90, head dims up to 256 there)
    cuda_major: int
    assumed: bool

    def describe(self) -> str:
        sm = f"sm{self.capability[0]}{self.capability[1]}"
        cudnn = f"cuDNN {self.cudnn // 10000}.{self.cudnn // 100 % 100}.{self.cudnn % 100}" if self.cudnn else \
            "a recent cuDNN (9.16 or newer)"
        who = f"{sm} ({self.name})" if self.assumed else f"{self.name} ({sm})"
        return f"{who}, CUDA {self.cuda_major}, {cudnn}"


_ARCH = re.compile(r"(?:sm_?)?(\d+)(?:\.(\d))?")


def gpu_target(arch: str | None = None, index: int = 0) -> GpuTarget:
    """This machine's CUDA device `index` (its capability and cuDNN read without making a CUDA context), else an
    assumed one: `arch` as sm90, sm_86 or 8.9, or by default sm90 (H100 / H200) with a recent cuDNN."""
    cuda_major = int(str(torch.version.cuda or "13").split(".")[0])
    if arch is None and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(index)
        return GpuTarget(props.name, (props.major, props.minor), torch.backends.cudnn.version(), cuda_major, False)
    if arch is None:
        return GpuTarget("assumed: no GPU here, an H100 / H200", (9, 0), None, cuda_major, True)
    m = _ARCH.fullmatch(str(arch).strip().lower())
    if not m:
        raise InputError(f"--gpu-arch {arch!r} is not a compute capability: write e.g. sm90, sm_86 or 8.9")
    major, minor = (int(m.group(1)), int(m.group(2))) if m.group(2) else divmod(int(m.group(1)), 10)
    if not 5 <= major <= 12:
        raise InputError(f"--gpu-arch {arch!r}: compute capability {major}.{minor} is not a CUDA GPU of today "
                         "(sm50 to sm121)")
    return GpuTarget("assumed: --gpu-arch", (major, minor), None, cuda_major, True)


def sdpa_order(target: GpuTarget) -> list[str]:
    """PyTorch's SDPA priority on the target (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp): cuDNN first on
    sm90 / sm100 (with CUDA 12, sm90 / sm100 / sm103 only) when its cuDNN is newer than 9.15 and
    TORCH_CUDNN_SDPA_DEPRIORITIZED is unset; else flash, mem-efficient, math, cuDNN."""
    major, minor = target.capability
    new_cudnn = target.cudnn is None or target.cudnn > 91500
    arch = major in (9, 10) and (target.cuda_major >= 13 or minor in (0, 3))
    if arch and new_cudnn and os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "0") in ("", "0"):
        return ["cudnn", "flash", "efficient", "math"]
    return ["flash", "efficient", "math", "cudnn"]


def sdpa_can_use(kernel: str, dtype: str, head_dim: int, tokens_k: int, target: GpuTarget) -> bool:
    """Whether the kernel takes an SD call (no mask, no dropout, dense q, k, v in the layout diffusers' processor
    passes) on the target: each kernel's dtype, head-dim and architecture checks, as sdp_utils.cpp states them."""
    major, minor = target.capability
    half = dtype in ("float16", "bfloat16")
    if kernel == "cudnn":  # head dims up to 256 on sm90 / sm10x from cuDNN 9.10 (check_cudnn_tensor_shapes), else 128
        limit = 256 if ((major, minor) == (9, 0) or major == 10) and (target.cudnn is None or target.cudnn >= 91000) \
            else 128
        return half and major >= 8 and head_dim <= limit and head_dim % 8 == 0 and tokens_k > 1
    if kernel == "flash":
        return half and (8, 0) <= (major, minor) <= (12, 1) and head_dim <= 256
    if kernel == "efficient":
        alignment = (8 if half else 4) if major >= 8 else 1
        return (5, 0) <= (major, minor) <= (12, 1) and head_dim % alignment == 0 and (half or dtype == "float32")
    return kernel == "math"


def sdpa_choice(dtype: str, head_dim: int, tokens_k: int, device: str, target: GpuTarget | None = None) -> str:
    """The kernel SDPA runs for one call: 'cudnn', 'flash', 'efficient' or 'math'. PyTorch is asked
    (torch._fused_sdp_choice on small real tensors of the call's head dim and tokens: it cannot answer on fake ones)
    on the CPU, and on CUDA where this process holds the device's CUDA context already (a worker measuring a cell,
    asked of the driver: primary_context_active): its own answer for this GPU, cuDNN and build. Elsewhere (the
    planner, a sweep's parent, which make no context, with or without a GPU) the rule of sdpa_rule decides, so that
    asking never makes a context."""
    dev = torch.device(device)
    if dev.type == "cpu" or (target is None or not target.assumed) and devices.primary_context_active(dev.index or 0):
        return asked_sdpa_choice(dtype, head_dim, tokens_k, dev)
    return sdpa_rule(dtype, head_dim, tokens_k, target or gpu_target())


def sdpa_rule(dtype: str, head_dim: int, tokens_k: int, target: GpuTarget) -> str:
    """The kernel PyTorch's documented priority and checks pick on the target, with no GPU to ask."""
    return next(k for k in sdpa_order(target) if sdpa_can_use(k, dtype, head_dim, tokens_k, target))


def asked_sdpa_choice(dtype: str, head_dim: int, tokens_k: int, device: torch.device) -> str:
    """torch._fused_sdp_choice on real (1, 1, T, head_dim) tensors on the device (the call's tokens on CUDA, a few
    on the CPU): what SDPA would run. Real tensors also under the planner's fake-tensor mode."""
    from torch.nn.attention import SDPBackend
    from torch.utils._python_dispatch import _disable_current_modes

    from ..spec import torch_dtype

    cuda = device.type == "cuda"
    with _disable_current_modes():
        q = torch.empty(1, 1, 64 if cuda else 2, head_dim, dtype=torch_dtype(dtype), device=device)
        k = torch.empty(1, 1, max(tokens_k, 2) if cuda else max(2, min(tokens_k, 8)), head_dim, dtype=q.dtype,
                        device=device)
        choice = SDPBackend(torch._fused_sdp_choice(q, k, k))
    return {SDPBackend.FLASH_ATTENTION: "flash", SDPBackend.EFFICIENT_ATTENTION: "efficient",
            SDPBackend.CUDNN_ATTENTION: "cudnn"}.get(choice, "math")
