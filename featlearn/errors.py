"""Errors raised by featlearn before any work starts or when a run must stop."""


class ConfigError(ValueError):
    """A configuration value is outside what the method allows.

    The message always names the field, the allowed values and what was given, e.g.
    ``data.keep_prob: must be in (0, 1), got 1.5``. The range of a single field is declared by its type
    annotation and raised by :func:`featlearn.validation.check_args`; rules that involve several fields
    raise it directly.

    Example:
        >>> raise ConfigError("keep_prob", "in (0, 1)", 1.5)
        Traceback (most recent call last):
        featlearn.errors.ConfigError: keep_prob: must be in (0, 1), got 1.5
    """

    def __init__(self, field: str, allowed: str, got: object):
        self.field, self.allowed, self.got = field, allowed, got
        super().__init__(f"{field}: must be {allowed}, got {got!r}")


class DivergenceError(RuntimeError):
    """A training quantity became NaN or infinite; the message says which and at which step."""
