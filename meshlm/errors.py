"""The base of every error that bad input causes: a config field, a layout, a data, checkpoint or model file,
a plan request. Each is phrased as one line naming the field or file and what would be valid, so the CLI
prints it without a traceback; a library user can catch them all as `InputError`."""


class InputError(ValueError):
    """Bad input, phrased as one line that names the field or file and what would be valid."""


class ConfigError(InputError):
    """A configuration problem, already phrased as one line naming the field."""
