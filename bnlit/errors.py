"""Errors a person can act on. Each message is one line naming the file or field and the fix;
``bnlit.train`` prints it without a traceback and exits non-zero."""


class BnlitError(Exception):
    """Base class for user-facing errors."""

    exit_code = 2


class ConfigError(BnlitError, ValueError):
    """A config value is invalid or inconsistent with another (also a ``ValueError``, what a
    constructor raises for a bad argument)."""


class DataError(BnlitError):
    """A data source, file or shard is missing, empty, unreadable or inconsistent."""


class TokenizerError(BnlitError):
    """A tokenizer cannot be trained or loaded, or does not fit the model."""


class CheckpointError(BnlitError):
    """A checkpoint or output directory cannot be used as asked."""
