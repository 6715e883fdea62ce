"""Errors of the app layer that the CLI reports as a user's mistake (exit status 2)."""


class CheckpointError(ValueError):
    """A warm-up checkpoint is missing, malformed or of another shape."""


class UsageError(ValueError):
    """A command's flags or arguments cannot work together (said with the fix)."""
