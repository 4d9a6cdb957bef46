"""The one exception root of ccld, and the environment failures the CLI turns into fix-it hints."""


class CcldError(Exception):
    """Base of every error ccld raises on purpose. Its message is meant for the user."""


class EnvironmentProblem(CcldError):
    """Something about this machine stops a source from working; `hint` says how to fix it."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint
