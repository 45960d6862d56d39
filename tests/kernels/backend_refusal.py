"""What an explicit `runtime.backend=triton` raises for a call its provider refuses, shared by the kernel tests."""

import re

import pytest
import torch

from mtpfactory import ops
from mtpfactory.errors import ConfigError, InputError


def assert_backend_refuses(op, field: str, *args, **kwargs) -> None:
    """Call `op` under the explicit backend the caller entered, on operands its provider refuses naming `field`:
    where the op's contract refuses them too (the reference would: wrong under every backend), the contract's
    own error, naming its argument; else the backend's ConfigError naming the op and the operand refused."""
    why = op.contract(*args, **kwargs)
    if why is not None:
        with pytest.raises(type(why), match=rf"^{re.escape(why.field)}="):
            op(*args, **kwargs)
    else:
        with pytest.raises(ConfigError, match=rf"op {op.name} has no triton provider .*it refuses {field}="):
            op(*args, **kwargs)


def assert_overlap_refused(op, field: str, shares: str, *args, **kwargs) -> None:
    """Under `runtime.backend=triton`, `op(*args, **kwargs)`, whose `field` (an out=) shares memory with its input
    `shares`: the provider refuses it (an InputError naming both, which the backend's error repeats, naming the
    op), before it writes anything: every tensor of the call holds what it held."""
    why = op.providers["triton"].refusal(*args, **kwargs)
    assert isinstance(why, InputError) and (why.field, why.value) == (field, f"memory shared with {shares}"), why
    before = [storage_bytes(t) for t in ops._tensors(args, kwargs)]
    with ops.use_backend("triton"), pytest.raises(
            ConfigError, match=rf"op {op.name} has no triton provider .*it refuses {re.escape(field)}='memory "
                               rf"shared with {shares}'"):
        op(*args, **kwargs)
    after = [storage_bytes(t) for t in ops._tensors(args, kwargs)]
    assert all(torch.equal(a, b) for a, b in zip(after, before)), "a refused call wrote"


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A copy of the bytes of t's whole storage (where NaN compares equal to itself)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).clone()
