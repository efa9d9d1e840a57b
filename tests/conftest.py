import pytest
import torch

from profiler import models


@pytest.fixture(scope="session")
def tiny_sd15():
    return models.build("tiny-sd15", weights="random", dtype="float32")


@pytest.fixture(scope="session")
def tiny_sdxl():
    return models.build("tiny-sdxl", weights="random", dtype="float32")


@pytest.fixture(autouse=True)
def _few_threads():
    torch.set_num_threads(2)
