"""One table of GPUs, shipped as data: each one's memory (for --budget NAME and the dashboard's Planner page) and its
published dense throughput and memory bandwidth (for plan / fit --gpu NAME: the roofline bound of a GPU you do not
have). Every row names its source, the vendor's datasheet or architecture whitepaper.

Throughput is dense (the datasheets' starred figures are with 2:4 sparsity, twice these), in TFLOP/s: fp16 and bf16
are the tensor-core rates with float32 accumulation (what PyTorch's matmuls and SDPA kernels use; the GeForce cards
run it at half their float16-accumulate rate), fp32 the CUDA-core FP32 rate (PyTorch's float32 matmuls do not use
TF32 unless asked: torch.backends.cuda.matmul.allow_tf32), tf32 the TF32 tensor rate, which float32 convolutions
take by default (torch.backends.cudnn.allow_tf32 is True; none before Ampere). Bandwidth in GB/s (10^9 bytes), memory
as the datasheet writes it: "80 GB" of HBM or GDDR is 80 GiB of chips (binary sizes; nvidia-smi shows a little less,
some held for ECC and the driver), so memory is read as GiB. None: the GPU has no such tensor rate (bfloat16 before
Ampere). Board power, SM count and boost clock (the clock the peaks are quoted at) tell whether the board can hold
that clock (sustained); the line says whether it is a datacenter card or a GeForce one (planner/published.py carries
a GPU's efficiencies within its line).
"""
from __future__ import annotations

import hashlib
import json
import re

from .errors import InputError

GiB = 2**30
_H100 = "NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100)"
_A100 = "NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/a100)"

# name, aliases, architecture (compute capability), memory GiB, bandwidth GB/s, fp16 / bf16 / fp32 / tf32 TFLOP/s,
# board power W, SMs, boost clock MHz, process node, line (datacenter or geforce), source
_ROWS = (
    ("H200", ("H200-SXM",), "sm90", 141, 4800, 989.5, 989.5, 67.0, 494.7, 700, 132, 1980, "TSMC 4N Hopper",
     "datacenter", "NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200), H200 SXM"),
    ("H100-SXM", ("H100", "H100-SXM5"), "sm90", 80, 3350, 989.5, 989.5, 67.0, 494.7, 700, 132, 1980,
     "TSMC 4N Hopper", "datacenter", f"{_H100}, H100 SXM"),
    ("H100-PCIE", ("H100-PCIe",), "sm90", 80, 2000, 756.5, 756.5, 51.0, 378.0, 350, 114, 1755, "TSMC 4N Hopper",
     "datacenter", f"{_H100}, H100 PCIe"),
    ("A100-80GB", ("A100-SXM-80GB", "A100-80G"), "sm80", 80, 2039, 312.0, 312.0, 19.5, 156.0, 400, 108, 1410,
     "TSMC N7", "datacenter", f"{_A100}, A100 80GB SXM"),
    ("A100-40GB", ("A100", "A100-SXM-40GB", "A100-40G"), "sm80", 40, 1555, 312.0, 312.0, 19.5, 156.0, 400, 108,
     1410, "TSMC N7", "datacenter", f"{_A100}, A100 40GB"),
    ("L40S", (), "sm89", 48, 864, 362.05, 362.05, 91.6, 183.0, 350, 142, 2520, "TSMC 4N Ada", "datacenter",
     "NVIDIA L40S datasheet (nvidia.com/en-us/data-center/l40s)"),
    ("L4", (), "sm89", 24, 300, 121.0, 121.0, 30.3, 60.0, 72, 58, 2040, "TSMC 4N Ada", "datacenter",
     "NVIDIA L4 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/l4)"),
    ("A10", (), "sm86", 24, 600, 125.0, 125.0, 31.2, 62.5, 150, 72, 1695, "Samsung 8N", "datacenter",
     "NVIDIA A10 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/products/a10-gpu)"),
    ("RTX-4090", ("4090", "RTX4090"), "sm89", 24, 1008, 165.2, 165.2, 82.6, 82.6, 450, 128, 2520, "TSMC 4N Ada",
     "geforce", "NVIDIA Ada Lovelace GPU Architecture whitepaper v2.0, appendix table 2 (GeForce RTX 4090)"),
    ("RTX-3090", ("3090", "RTX3090"), "sm86", 24, 936, 71.0, 71.0, 35.6, 35.6, 350, 82, 1695, "Samsung 8N",
     "geforce", "NVIDIA Ampere GA102 GPU Architecture whitepaper v2.0, table 9 (GeForce RTX 3090)"),
    ("T4", (), "sm75", 16, 320, 65.0, None, 8.1, None, 70, 40, 1590, "TSMC 12FFN", "datacenter",
     "NVIDIA T4 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/tesla-t4)"),
    ("V100-32GB", ("V100",), "sm70", 32, 900, 125.0, None, 15.7, None, 300, 80, 1530, "TSMC 12FFN", "datacenter",
     "NVIDIA V100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/v100), V100 SXM2"),
)


def _norm(name: str) -> str:
    return re.sub(r"[\s_-]", "", str(name)).upper()


_BY_NAME = {_norm(n): row for row in _ROWS for n in (row[0], *row[1])}


def names() -> list[str]:
    return [row[0] for row in _ROWS]


def known_line() -> str:
    return "known GPUs: " + ", ".join(f"{r[0]} ({r[3]} GiB)" for r in _ROWS)


def find(name: str) -> dict | None:
    """The GPU of this name or alias (case, spaces, '-' and '_' ignored), else None."""
    row = _BY_NAME.get(_norm(name))
    if row is None:
        return None
    name, aliases, arch, mem, bw, fp16, bf16, fp32, tf32, watts, sms, mhz, node, line, source = row
    return {"name": name, "aliases": list(aliases), "arch": arch, "memory_bytes": mem * GiB, "memory_gib": mem,
            "bytes_per_s": bw * 1e9, "tflops": {"float16": fp16, "bfloat16": bf16, "float32": fp32},
            "tf32_tflops": tf32, "watts": watts, "sms": sms, "boost_mhz": mhz, "node": node, "line": line,
            "source": source}


def get(name: str, where: str = "--gpu") -> dict:
    """find(), or one line naming the known GPUs."""
    gpu = find(name)
    if gpu is None:
        raise InputError(f"{where} {name!r} is not a known GPU: {known_line()}")
    return gpu


def limits(gpu: dict, dtype: str) -> dict:
    """The GPU's published limits in the shape of a measured device's (measure/limits.py), for the roofline."""
    tflops = gpu["tflops"][dtype]
    if tflops is None:
        raise InputError(f"the {gpu['name']} has no {dtype} tensor throughput ({gpu['source']}): plan another "
                         "dtype (--dtype float16)")
    return {"device_peak_flops": {dtype: tflops * 1e12}, "device_peak_bytes_per_s": gpu["bytes_per_s"],
            "device_limits": {"key": f"{gpu['name']} (published)", "source": gpu["source"], "device": "cuda"}}


def peak_flops(gpu: dict, dtype: str, what: str = "matmul", tf32: bool = False) -> float:
    """FLOP/s of the op class at the clock the board holds (sustained): a float32 convolution at the TF32 rate where
    the GPU has one (cuDNN's default), a float32 matmul too where tf32 (torch.set_float32_matmul_precision("high")
    or torch.backends.cuda.matmul.allow_tf32: off by default), a float32 fused attention kernel's GEMMs ("attention")
    at a third of the TF32 rate where the GPU has one (PyTorch's and xformers' memory-efficient kernels run float32
    as 3xTF32 on sm80 and newer, CUTLASS's OpMultiplyAddFastF32, whatever allow_tf32 says), everything else at the
    dtype's rate."""
    if what == "attention" and dtype == "float32" and gpu["tf32_tflops"]:
        return gpu["tf32_tflops"] / 3 * 1e12 * sustained(gpu)[0]
    tf32 = dtype == "float32" and (what == "convolution" or tf32) and gpu["tf32_tflops"]
    tflops = gpu["tf32_tflops"] if tf32 else gpu["tflops"][dtype]
    return tflops * 1e12 * sustained(gpu)[0]


def sustained(gpu: dict) -> tuple[float, str]:
    """(the share of its boost clock the board holds under tensor load, why): dynamic power taken as SMs x clock^3
    (voltage scaling with the clock), its constant per process node from the node's part of the table with the most
    power per SM at its clock (assumed to hold its boost); a board whose power is below that at its boost runs at the
    clock its power allows (the T4's 70 W: 75%). Assumed, from the datasheets' power, SMs and clocks: no GPU measured
    it."""
    per = lambda g: g["watts"] / (g["sms"] * (g["boost_mhz"] / 1e3) ** 3)  # noqa: E731
    same = [find(r[0]) for r in _ROWS if r[12] == gpu["node"]]
    ref = max(same, key=per)
    share = min(1.0, (per(gpu) / per(ref)) ** (1 / 3))
    if share >= 1.0:
        return 1.0, "its boost clock"
    return share, (f"{share:.0%} of its boost clock: {gpu['watts']} W for {gpu['sms']} SMs at {gpu['boost_mhz']} MHz, "
                   f"against the {ref['name']}'s {ref['watts']} W for {ref['sms']} at {ref['boost_mhz']} ({gpu['node']}; "
                   "power taken as SMs x clock^3, assumed)")


def describe(gpu: dict, dtype: str) -> str:
    t = gpu["tflops"][dtype]
    return (f"{gpu['name']} ({gpu['arch']}): {t:g} TFLOP/s dense {dtype}, {gpu['bytes_per_s'] / 1e12:g} TB/s, "
            f"{gpu['memory_gib']} GiB (published: {gpu['source']})")


def arch_of(environment: dict) -> str | None:
    """A stored run's GPU architecture: its environment's device_arch (recorded since 2026-12-03), else that of the
    table's GPU whose name or alias its device name holds as a word (torch names an H100 "NVIDIA H100 80GB HBM3");
    None for a CPU or a GPU not in the table."""
    if environment.get("device_arch"):
        return environment["device_arch"]
    row = named_in(environment.get("device_name"))
    return row["arch"] if row else None


def named_in(device_name) -> dict | None:
    """The table's GPU whose name or alias the device name holds as a word ("NVIDIA H200": the H200), or None."""
    words = {_norm(w) for w in re.split(r"[\s_-]+", str(device_name or ""))}
    return next((find(row[0]) for row in _ROWS for n in (row[0], *row[1]) if _norm(n) in words), None)


# A fused attention kernel's forward throughput against the GPU's dense peak, per architecture: (fraction, source),
# from the papers' forward benchmarks at head dim 64 (SDXL's; SD 1.5's 40-160 run the same kernels). The time model
# fits each kernel to the kernel times a GPU printed (planner/kernels.py) and carries the fit to another architecture
# by these figures' ratio; a kernel no paper benchmarks on an architecture takes the figure named in its source.
REFERENCES = {
    "FA3 paper fig. 5a": "FlashAttention-3 paper (Shah et al. 2024, arXiv:2407.08608), figure 5a: forward, head dim "
                         "64, no causal mask, H100 80GB SXM5, batch x sequence 16k, hidden 2048; TFLOP/s at 4k tokens",
    "FA2 paper": "FlashAttention-2 paper (Dao 2023, arXiv:2307.08691): forward 50-73% of the A100's peak, the low end "
                 "at head dim 64",
}
ATTENTION = {
    "flash": {"sm90": (321 / 989.5, "FA3 paper fig. 5a: FlashAttention-2 321 TFLOP/s on the H100"),
              "sm80": (0.50, "FA2 paper: 50% of the A100's peak"),
              **{a: (0.50, "assumed as the A100's (FA2 paper)") for a in ("sm70", "sm75", "sm86", "sm89")}},
    "cudnn": {"sm90": (408 / 989.5, "FA3 paper fig. 5a: cuDNN 408 TFLOP/s on the H100")},
    "fa3": {"sm90": (476 / 989.5, "FA3 paper fig. 5a: FlashAttention-3 476 TFLOP/s on the H100")},
    "naive": {"sm90": (72 / 989.5, "FA3 paper fig. 5a: standard attention 72 TFLOP/s on the H100")},
}
SCALES_AS = {"efficient": "flash", "cudnn": "flash"}  # assumed: sm80-style kernels, scaled between archs as FA2's


def attention_scale(kernel: str, data_arch: str, arch: str) -> tuple[float, str]:
    """What a kernel's fitted coefficient on data_arch is multiplied by on arch (its published efficiency on
    data_arch over that on arch), and why. 1 where the two are one architecture or no figure says otherwise
    (assumed)."""
    if arch == data_arch:
        return 1.0, "fitted on this architecture"
    for k in (kernel, SCALES_AS.get(kernel)):
        table = ATTENTION.get(k or "", {})
        if data_arch in table and arch in table:
            (here, src_here), (there, src_there) = table[data_arch], table[arch]
            how = "" if k == kernel else f", assumed to scale as {k}'s"
            return here / there, f"{k} {here:.0%} of the peak on {data_arch} ({src_here}) over {there:.0%} on {arch} " \
                                 f"({src_there}){how}"
    return 1.0, f"assumed: the same share of the peak on {arch} as on {data_arch}"


# Efficiency of each op class against the table's roofline, per architecture: (fraction, where it comes from). The
# attention kernels' are published forward-pass benchmarks at the head dims of these U-Nets (40-64, where each paper's
# figures are lowest); what no paper gives is marked assumed. Memory-bound work (naive, sliced, query-split and
# sub-quadratic attention, SDPA's math kernel, norms and elementwise ops) is a share of the published bandwidth.
_FA2 = ("FlashAttention-2 paper (Dao 2023, arXiv:2307.08691): forward 50-73% of the A100's peak, the low end at head "
        "dim 64")
_FA2_H100 = ("FlashAttention-3 paper (Shah et al. 2024, arXiv:2407.08608): FlashAttention-2 reaches 35% of the H100's "
             "peak (PyTorch's SDPA flash kernel is FlashAttention-2)")
_ASSUMED = "assumed: no published figure at these shapes"
_AS_A100 = "assumed as the A100's (no published figure for this architecture): " + _FA2
EFFICIENCY = {
    "flash": {"sm80": (0.50, _FA2), "sm86": (0.50, _AS_A100), "sm89": (0.50, _AS_A100), "sm90": (0.35, _FA2_H100)},
    "efficient": {"*": (0.25, "assumed half of flash's (the FlashAttention-2 paper: about 2x FlashAttention, which "
                               "the memory-efficient kernels match)")},
    "matmul": {"*": (0.70, _ASSUMED)},
    "convolution": {"*": (0.50, _ASSUMED)},
    "memory": {"*": (0.80, _ASSUMED)},
}
FUSED = {"sdpa": None, "sdpa-flash": "flash", "flash-attn": "flash", "flash-attn-3": "flash", "sdpa-cudnn": "flash",
         "sdpa-efficient": "efficient", "xformers": "efficient"}


def efficiency(what: str, arch: str) -> tuple[float, str] | None:
    table = EFFICIENCY[what]
    return table.get(arch) or table.get("*")


def digest() -> str:
    """The content of the tables the time model reads (the GPUs' figures, the op classes' efficiencies, the published
    attention shares and how kernels scale), hashed: a cached fit keyed on it is refitted after any edit to them."""
    tables = [_ROWS, EFFICIENCY, ATTENTION, SCALES_AS, FUSED]
    return hashlib.sha256(json.dumps(tables, sort_keys=True, default=str).encode()).hexdigest()[:16]
