"""The package's errors: every refusal names the field, the value, what is allowed and the fix."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class MtpfError(ValueError):
    """Base of every error mtpfactory raises for bad input (a `ValueError`)."""

    def __init__(self, field: str, value: object, allowed: str, fix: str = "") -> None:
        self.field, self.value, self.allowed, self.fix = field, value, allowed, fix
        super().__init__(f"{self.what}. Fix: {fix}" if fix else self.what)

    @property
    def what(self) -> str:
        """`field=value: allowed`, the error without its fix."""
        return f"{self.field}={_show(self.value)}: {self.allowed}"


class ConfigError(MtpfError):
    """A configuration value or combination that is not allowed."""


class UnknownNameError(ConfigError):
    """A head, component or op name that no registry holds."""

    def __init__(self, field: str, value: str, known: Iterable[str]) -> None:
        known = sorted(known)
        lowered = {k.lower(): k for k in known}  # `kv=FP8` is close to `fp8` (difflib compares capitals apart)
        close = [lowered[c] for c in difflib.get_close_matches(str(value).lower(), list(lowered), n=1)]
        fix = f"did you mean '{close[0]}'?" if close else f"choose one of {', '.join(known)}"
        super().__init__(field, value, f"unknown; known: {', '.join(known) or '(none)'}", fix)
        self.known, self.suggestion = known, (close[0] if close else None)


class WeightsError(MtpfError):
    """A checkpoint tensor that is missing, misshapen or not finite, or an FFN form the weights lack."""


class InputError(MtpfError):
    """A call argument (token ids, hidden, positions, sequence ids) that the head refuses."""


class KVPoolExhaustedError(InputError):
    """The drafter's KV pool has no free block for a write."""


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
