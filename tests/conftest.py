"""Test-wide setup. With no GPU, Triton kernels run under Triton's interpreter: the variable must be set
before triton is first imported (DESIGN 4)."""

import os
import shutil

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
