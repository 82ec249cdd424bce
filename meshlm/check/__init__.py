"""`meshlm check`: prove a run exact before it starts, on a CPU replica of its model, plan, data and layout.

The replica (meshlm.check.shrink) is trained for a few steps at world 1 and at the mapped layout, each by the
real trainer (`meshlm.fit`) on gloo, the layout under torchrun (meshlm.check.worker); meshlm.check.run compares
their losses, gradient norms and final weights, resumes the layout's checkpoint at world 1 (resharding) and, when a
step differs, names the first module whose gradient differs and the layout dimension that causes it.
"""

from __future__ import annotations

import sys
import types


def check(*args: object, **kwargs: object) -> object:
    """`meshlm.check(model, data, layout, plan=..., loss_fn=..., **parallel)`: meshlm.check.run.check_model."""
    from meshlm.check.run import check_model

    return check_model(*args, **kwargs)


class _Check(types.ModuleType):
    """Once imported, `meshlm.check` is this package: calling it calls `check`."""

    def __call__(self, *args: object, **kwargs: object) -> object:
        return check(*args, **kwargs)


sys.modules[__name__].__class__ = _Check
