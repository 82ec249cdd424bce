"""The base of every error that bad input causes: a config field, a layout, a data, checkpoint or model file,
a plan request. Each is phrased as one line naming the field or file and what would be valid, so the CLI
prints it without a traceback; a library user can catch them all as `InputError`."""


class InputError(ValueError):
    """Bad input, phrased as one line that names the field or file and what would be valid.

    In a job every rank meets the same one (each checks the same config, rank 0's verdicts are broadcast), so
    only rank 0 prints it; `rank_local` marks an error about one rank's own part, which every rank that
    meets it prints."""

    rank_local = False


class ConfigError(InputError):
    """A configuration problem, already phrased as one line naming the field."""


class RunStopped(RuntimeError):
    """A run stopped by a guard (a diverged run, a replica desync), phrased as one line that says why and what
    stays resumable; the CLI prints it without a traceback and exits 1 (meshlm.train.guards.TrainingFault)."""
