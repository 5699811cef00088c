"""One family of exceptions for everything a user can get wrong."""


class EaglejaxError(Exception):
    """Base class: the CLI prints these in one line and exits with status 2."""


class LoadError(EaglejaxError):
    """A model, checkpoint or tokenizer file is missing, corrupt or inconsistent."""


class ConfigError(EaglejaxError):
    """A configuration names something unsupported or contradicts itself."""


class InputError(EaglejaxError):
    """A prompt or generation argument is invalid."""
