"""Fewer starts for the same check (meshlm.check): a world-1 run is the worker alone, with no torchrun agent
(meshlm.check.run.run_job: the agent's start was a third of such a run's CPU time, and a check makes two to four
of them), and the localisation's run without a dimension that leaves world 1 is the reference's own job, not
started again (meshlm.check.localise.same_job).

What the agent reported of a rank killed by a signal, the process's own exit code says: `failure_reason` names
the signal from it. Mutation: without the exit code's branch the line is "no output" (the dp=2 case, with
torchrun's report, is tests/integration/test_check.py::test_a_rank_killed_by_a_signal_is_named_with_its_python_stack).
"""

from meshlm.check.localise import same_job
from meshlm.check.run import failure_reason, without
from meshlm.config import Config

ABORTED = 'Fatal Python error: Aborted\n\nThread 0x00007f (most recent call first):\n  File "x.py", line 3 in f\n'


def test_a_world1_run_killed_by_a_signal_is_named_from_its_exit_code() -> None:
    assert failure_reason(ABORTED, -6) == "rank 0 died of SIGABRT (Fatal Python error: Aborted)"
    assert failure_reason("", -9) == "rank 0 died of SIGKILL"


def test_an_error_line_still_comes_first_and_a_plain_failure_says_no_output() -> None:
    assert failure_reason("Traceback ...\nValueError: bad shape\n", 1) == "ValueError: bad shape"
    assert failure_reason("some output\n", 1) == "no output"


def _config(layout: str, **parallel: object) -> Config:
    train = {"global_batch": 8, "micro_batch": 2 if "pp" in layout else 0, "device": "cpu", "compile": False}
    return Config.model_validate({"data": {"seq_len": 32}, "train": train, "parallel": {"layout": layout, **parallel}})


def test_the_localisation_reuses_the_reference_where_a_dimension_removed_leaves_world_1() -> None:
    """`same_job`: tp=2 (with sequence parallel), dp=2 ZeRO-3 and pp=2 without their one dimension are the
    world-1 reference's own job, so the localisation does not start it again; a layout of two dimensions without
    one is still a layout, and a changed step or config is another job. Mutation: `same_job` always False
    starts the run (test_check.py's mutation cases then list its phase)."""
    for layout, parallel, dim in [
        ("tp=2", {"sequence_parallel": True}, "tp"),
        ("dp=2", {"zero": 3}, "dp"),
        ("pp=2", {"schedule": "interleaved", "virtual_stages": 2}, "pp"),
    ]:
        cfg = _config(layout, **parallel)
        smaller, options = without(cfg, dim)
        assert same_job(cfg, smaller, options, 1), (layout, smaller, options)
    cfg = _config("dp=2,tp=2")
    assert not any(same_job(cfg, *without(cfg, dim), 1) for dim in ("dp", "tp"))
    assert not same_job(cfg, "tp=1", {"zero": 1}, 1)  # an option the reference does not have
