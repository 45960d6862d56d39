"""Test-wide setup. With no GPU, Triton kernels run under Triton's interpreter: the variable must be set
before triton is first imported (DESIGN 4).

`python -m pytest` puts the working directory first on sys.path, and from the checkout's root that makes its
`kernels/` folder (installed as `mtpfactory.kernels`) shadow the `kernels` distribution, which transformers
(from 5.25, the heads' oracle) imports: `from kernels import CUDAProperties` then fails. The checkout's root
comes off sys.path here; the tests import the installed package."""

import os
import shutil
import sys

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]
