"""Command-line overrides for short training runs, shared by the tests that start `meshlm train` (the
`small_run` fixture in tests/conftest.py gives them for a test's own run directory)."""

from pathlib import Path


def small_run_args(data_cache: str, run_dir: Path) -> list[str]:
    """Overrides for a fast training run of the `test` preset on real text."""
    return [
        "--model.preset", "test",
        "--data.max_chars", "1500000",
        "--data.cache_dir", data_cache,
        "--data.seq_len", "64",
        "--train.global_batch", "8",
        "--train.warmup_steps", "2",
        "--train.eval_batches", "2",
        "--log.run_dir", str(run_dir),
        "--log.progress", "false",
        "--log.tensorboard", "false",
    ]  # fmt: skip
