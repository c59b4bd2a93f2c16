import pytest


@pytest.fixture(autouse=True)
def _cpu_threads():
    """Keep tests deterministic and polite on 2 cores."""
    import torch

    torch.set_num_threads(1)
    yield
