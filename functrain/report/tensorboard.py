"""TensorBoard event files through tensorboardX, opened without importing torch."""

import sys
from typing import Any


def summary_writer(log_dir: str, **options: Any) -> Any:
    """A tensorboardX ``SummaryWriter`` writing into ``log_dir`` (``options``: the writer's own keywords).

    tensorboardX imports torch when it is installed, only to accept torch tensors: 1.7 s of every run's start-up
    where the torch extra is present. functrain logs Python numbers, so unless torch is loaded already (the torch
    backend) tensorboardX is imported with torch unavailable.
    """
    hide_torch = "torch" not in sys.modules
    if hide_torch:
        sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` raises ImportError meanwhile
    try:
        from tensorboardX import SummaryWriter
    finally:
        if hide_torch:
            del sys.modules["torch"]
    return SummaryWriter(log_dir, **options)
