"""User-facing errors: one clear line each, caught by the CLI and the UI."""


class QuickdraftError(Exception):
    """An error whose message is meant for the user as it stands (no traceback)."""


class ModelLoadError(QuickdraftError):
    """The requested model could not be resolved or loaded."""


class PromptError(QuickdraftError):
    """The prompt cannot be used (empty, or not encodable)."""


class AcceleratorError(QuickdraftError):
    """An accelerator checkpoint is missing, corrupt or built for another model."""
