"""User-facing errors: one paragraph that names the culprit and the fix, exit code 2."""


class UserError(Exception):
    """A mistake in the user's input (config, data, paths, checkpoints).

    The CLI prints ``str(err)`` as one paragraph and exits with ``exit_code``, without a
    traceback unless ``--debug`` is given.
    """

    exit_code = 2

    def __init__(self, message: str, *, key: str | None = None):
        self.key = key
        self.message = f"{key}: {message}" if key else message  # kept when Ray wraps the error
        super().__init__(self.message)


class ConfigError(UserError):
    """A config key is unknown, has the wrong type, or an invalid value."""
