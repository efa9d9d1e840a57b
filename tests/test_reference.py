"""Measure the backend, not the harness: the fp32 reference of a group is computed first, by a model freed before
the model under test is built, and kept on the CPU; the budget holds the forward alone; where the device cannot
hold the fp32 model, the reference moves to the CPU and the cell says so."""
import gc
import weakref

import pytest
import torch

from profiler import devices
from profiler.unet import models
from profiler.execute.grid import Sweep
from profiler.execute.sweep import execute, predict
from profiler.measure import cell as runner
from profiler.store import Run


def _sweep(tmp_path, **kw) -> Sweep:
    return Sweep(**{"models": ("tiny-sd15",), "sizes": ((128, 128), (192, 128)), "dtypes": ("float16",),
                    "device": "cpu", "repeats": 1, "warmup": 0, "backends": (("sdpa", ()), ("naive", ())),
                    "out": str(tmp_path / "results"), **kw})


def test_the_reference_model_is_gone_before_the_model_under_test_is_built(tmp_path, monkeypatch):
    """One fp32 model computes the references of both sizes, and no reference of it is alive when the float16
    model is built, nor while its cells run; the outputs it left are on the CPU."""
    built, real_build = [], models.build

    def build(source, weights="random", device="cpu", dtype="float32", seed=0):
        gc.collect()
        alive = [d for d, ref, _ in built if ref() is not None]  # the models built before, still referenced
        unet = real_build(source, weights, device, dtype, seed)
        if weights != "meta":  # the preflight's meta and fake models hold no memory
            built.append((dtype, weakref.ref(unet), alive))
        return unet

    monkeypatch.setattr(models, "build", build)
    cells = Run.open(execute(_sweep(tmp_path), workers=False, progress=False).run_path).cells()
    assert set(cells["status"]) == {"ok"} and len(cells) == 4
    assert [b[0] for b in built] == ["float32", "float16"]  # one reference model for both sizes, one under test
    assert built[1][2] == []  # nothing else alive when the model under test was built
    assert set(cells["reference"]) == {"sdpa/float32"}
    assert (cells["max_rel_err"] < runner.TOLERANCE["float16"]).all()


def test_a_float16_cell_whose_budget_holds_its_forward_but_not_the_reference_too_runs(tmp_path):
    """The preflight's need is the forward's own peak (weights, inputs, transient): a budget 1 MiB over it runs
    the cell, though the fp32 reference's weights would not fit beside it."""
    sweep = _sweep(tmp_path, sizes=((128, 128),), backends=(("sdpa", ()),))
    spec = sweep.cells("cpu")[0]
    predicted = predict([spec])[0][spec.cell_id]
    weights32 = sum(p.numel() * 4 for p in models.build("tiny-sd15", weights="meta").parameters())
    budget = predicted["predicted_forward_peak_bytes"] + 2**20
    assert predicted["predicted_need_bytes"] == predicted["predicted_forward_peak_bytes"]
    assert budget < predicted["predicted_forward_peak_bytes"] + weights32  # the old need would not have fit
    from dataclasses import replace

    cells = Run.open(execute(replace(sweep, memory_budget=budget), workers=False, progress=False).run_path).cells()
    assert cells.iloc[0]["status"] == "ok", cells.iloc[0]["error"]


def test_a_device_that_cannot_hold_the_fp32_model_gets_its_references_from_the_cpu(monkeypatch):
    """An allocation failure while the fp32 model is built on the device moves the references to the CPU, and
    the cells' `reference` says where and why; any other failure is the reference's failure, kept for its cells."""
    real_build = models.build

    def build(source, weights="random", device="cpu", dtype="float32", seed=0):
        if str(device).startswith("cuda"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.57 GiB")
        return real_build(source, weights, "cpu", dtype, seed)

    monkeypatch.setattr(runner.models, "build", build)
    monkeypatch.setattr(devices.Cuda, "release", lambda self: None)
    cache = runner.ModelCache()
    specs = [runner.CellSpec("tiny-sd15", w, 128, 1, "float16", "sdpa", "cuda") for w in (128, 192)]
    cache.expect(specs)
    out, label = cache.reference(specs[0])
    assert out.device.type == "cpu" and out.dtype == torch.float32 and out.shape == (1, 4, 16, 16)
    assert label == ("sdpa/float32 on the CPU: cuda could not hold it (OutOfMemoryError: CUDA out of memory. Tried "
                     "to allocate 9.57 GiB)")
    assert cache.reference(specs[1])[1] == label  # both shapes in one pass
    cpu = runner.ModelCache().reference(runner.CellSpec("tiny-sd15", 128, 128, 1, "float16", "sdpa", "cpu"))[0]
    assert torch.equal(out, cpu)  # the same seeded weights wherever they are built


def test_a_reference_failure_that_is_no_allocation_failure_is_not_retried_on_the_cpu(monkeypatch):
    calls = []

    def build(source, weights="random", device="cpu", dtype="float32", seed=0):
        calls.append(device)
        raise RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED")

    monkeypatch.setattr(runner.models, "build", build)
    monkeypatch.setattr(devices.Cuda, "release", lambda self: None)
    spec = runner.CellSpec("tiny-sd15", 128, 128, 1, "float16", "sdpa", "cuda")
    with pytest.raises(runner.ReferenceFailed, match="CUDNN_STATUS_NOT_SUPPORTED") as failed:
        runner.ModelCache().reference(spec)
    assert calls == ["cuda"] and not failed.value.oom


def test_the_reference_forward_runs_with_tf32_off_and_the_settings_come_back():
    """The fp32 reference at full float32 precision: TF32 off for cuBLAS and cuDNN during each of its module calls
    (on by default for cuDNN on a GPU), both flags restored after, also when the model under test is float16."""
    from profiler.spec import CellSpec

    seen = []
    hook = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, args: seen.append((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)))
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        spec = CellSpec("tiny-sd15", 64, 64, 1, "float16", "sdpa", "cpu")
        out, label = runner.ModelCache().reference(spec)
        after = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    finally:
        hook.remove()
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
    assert label == "sdpa/float32" and out.dtype == torch.float32
    assert len(seen) > 100 and set(seen) == {(False, False)}  # every module call of the reference forward
    assert after == (True, True)
