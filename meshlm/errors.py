"""The base of every error that bad input causes: a config field, a layout, a data, checkpoint or model file,
a plan request. Each is phrased as one line naming the field or file and what would be valid, so the CLI
prints it without a traceback; a library user can catch them all as `InputError`."""

import re

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def one_line(text: str) -> str:
    """`text` with control characters (a newline in a file name or a value) written as escapes, so a message
    that quotes what the user gave stays one line."""
    return _CONTROL.sub(lambda m: m[0].encode("unicode_escape").decode(), text.strip())


class InputError(ValueError):
    """Bad input, phrased as one line that names the field or file and what would be valid.

    In a job every rank meets the same one (each checks the same config, rank 0's verdicts are broadcast), so
    only rank 0 prints it; `rank_local` marks an error about one rank's own part, which every rank that
    meets it prints."""

    rank_local = False

    def __init__(self, message: object = "", *args: object) -> None:
        super().__init__(one_line(str(message)), *args)


class ConfigError(InputError):
    """A configuration problem, already phrased as one line naming the field."""


class RunStopped(RuntimeError):
    """A run stopped by a guard (a diverged run, a replica desync), phrased as one line that says why and what
    stays resumable; the CLI prints it without a traceback and exits 1 (meshlm.train.guards.TrainingFault)."""
