"""What an explicit `runtime.backend=triton` raises for a call its provider refuses, shared by the kernel tests."""

import re

import pytest

from mtpfactory.errors import ConfigError


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
