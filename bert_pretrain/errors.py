"""Errors the user can cause and fix.

The entry points catch `UserError` and print `bert-train: error: <message>` (exit status 2, no
traceback): a traceback from deep inside torch or numpy tells a user nothing about which config
value or file to change.  Every message says what is wrong and how to fix it, on one line.
"""


class UserError(Exception):
    """Base class: a problem in the user's config, data or checkpoints (not a bug)."""


class ConfigError(UserError):
    """A config value is missing, misspelt or out of range."""


class DataError(UserError):
    """The prepared data directory is missing, incomplete or does not match the model."""


class CheckpointError(UserError):
    """A checkpoint is missing, corrupt or belongs to a different model."""


class TrainingError(UserError):
    """Training cannot continue (e.g. the loss stayed non-finite); the message says what to try."""
