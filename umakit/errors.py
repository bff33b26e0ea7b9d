"""Typed errors raised by the library.

Every message is one actionable line meant for the user; the CLI turns any
`UmakitError` into ``Error: <message>`` and a non-zero exit in one place.
"""


class UmakitError(Exception):
    """Base class of every error umakit raises on purpose."""


class ModelNotFoundError(UmakitError):
    """A model path, Hub repo or built-in model could not be found."""


class ConfigError(UmakitError):
    """config.json is missing, unreadable or lacks required fields."""


class CheckpointError(UmakitError):
    """Weights are missing, corrupt, truncated or of the wrong shape."""


class UnsupportedModelError(UmakitError):
    """The architecture, tensor type or format is not supported."""


class TokenizerError(UmakitError):
    """The tokenizer or chat template could not be loaded or applied."""


class BackendUnavailableError(UmakitError):
    """The requested backend or device is not installed or not present."""


class InvalidArgumentError(UmakitError, ValueError):
    """An argument has a value outside its allowed range."""


class DoesNotFitError(InvalidArgumentError):
    """The model, or the part of it that must stay resident, does not fit the memory it may use."""


class WriteError(UmakitError, OSError):
    """A file or directory could not be written (full disk, read-only filesystem, bad parent, a lock held).

    Also an `OSError`, so code that handled the raw error keeps handling it."""


class BusyError(WriteError):
    """Another umakit process holds the lock of the place to write (`umakit.core.fsutil.locked`)."""
