import os

import pytest

os.environ.setdefault("IKBO_VALIDATE", "1")


def _sm90_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def pytest_collection_modifyitems(config, items):
    if _sm90_available():
        return
    skip = pytest.mark.skip(reason="needs an sm_90 (Hopper) GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
