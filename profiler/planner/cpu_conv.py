"""What a convolution allocates on the CPU beside its output: the buffers of the kernel PyTorch picks, which fake
tensors do not allocate (their convolution returns the output only).

PyTorch picks the kernel (torch._C._select_conv_backend, asked here on the fake tensors: it reads shapes, dtype,
device and torch's thread count). Measured with the profiler's allocation timeline, conv by conv, on torch 2.13's
CPU build (AVX-512 with AMX), against the oneDNN layouts ONEDNN_VERBOSE=1 prints:
- Slow2d (PyTorch's own im2col path, small float32 convolutions): the columns buffer, batch x in_channels x kh x kw
  x output pixels, alive with the output; none for a 1x1 convolution of stride 1 without padding.
- Mkldnn in float32 (oneDNN's direct convolution): the input reordered to channel blocks of 16 (aBcd16b; 8 on a
  CPU without AVX-512), channels padded up to the block, unless it has fewer channels than a block (oneDNN's first
  convolution reads it as it is); the weight reordered with both channel counts padded (only the output's where
  the input is read as it is); the bias padded, plus 128 bytes, where the output's channels are not a whole number
  of blocks; and the output computed in blocks (padded), then copied to the plain output after the input's and the
  weight's copies are freed. So the peak over the bytes alive before the call is the larger of
  bias + input copy + weight copy + blocked output, and blocked output + output.
- Mkldnn in bfloat16 / float16 (oneDNN's brgemm on channels-last copies): the input's and the output's
  channels-last copies and the weight's, then the output twice while the blocked one is still alive. The brgemm
  scratchpad (12 KiB in float16 here, up to a few MiB in bfloat16 with AMX) is not modelled: a lower bound.
"""
from __future__ import annotations

import math

import torch

BIAS_EXTRA = 128  # bytes that oneDNN's padded bias copy takes beyond its padded size (measured)


def block() -> int:
    """oneDNN's float32 channel block on this CPU: 16 with AVX-512, else 8."""
    return 16 if "AVX512" in torch.backends.cpu.get_cpu_capability() else 8


def _pad(channels: int, b: int) -> int:
    return -(-channels // b) * b


def workspace_bytes(args, out: torch.Tensor) -> int:
    """aten.convolution's buffers on the CPU beyond its output, at their peak: args are aten.convolution's (input,
    weight, bias, stride, padding, dilation, transposed, output_padding, groups); 0 for what is not modelled (a
    transposed or grouped convolution, a kernel other than these two)."""
    x, w, bias, stride, padding, dilation, transposed, _, groups = args[:9]
    if transposed or groups != 1 or x.dim() != 4:
        return 0
    kind = torch._C._select_conv_backend(x, w, bias, list(stride), list(padding), list(dilation), transposed,
                                         [0, 0], groups)
    es, n, ic, oc = x.element_size(), x.shape[0], x.shape[1], w.shape[0]
    pixels_in, pixels_out, taps = math.prod(x.shape[2:]), math.prod(out.shape[2:]), math.prod(w.shape[2:])
    out_bytes = out.numel() * es
    if kind == torch._C._ConvBackend.Slow2d:
        plain = taps == 1 and all(s == 1 for s in stride) and not any(padding)
        return 0 if plain else n * ic * taps * pixels_out * es
    if kind != torch._C._ConvBackend.Mkldnn:
        return 0
    if x.dtype != torch.float32:
        copies = x.numel() * es + w.numel() * es + out_bytes
        return max(copies, 3 * out_bytes) - out_bytes
    b = block()
    first = ic < b
    src = 0 if first else n * _pad(ic, b) * pixels_in * es
    weight = _pad(oc, b) * (ic if first else _pad(ic, b)) * taps * es
    bias_copy = _pad(oc, b) * es + BIAS_EXTRA if bias is not None and oc % b else 0
    dst = n * _pad(oc, b) * pixels_out * es
    return max(bias_copy + src + weight + dst, dst + out_bytes) - out_bytes
