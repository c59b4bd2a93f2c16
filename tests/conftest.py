import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@pytest.fixture(autouse=True)
def _cpu_threads():
    """Keep tests deterministic and polite on 2 cores."""
    import torch

    torch.set_num_threads(1)
    yield
