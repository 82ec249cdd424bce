"""`meshlm check`: a user's run proved exact before it starts, on a shrunken CPU replica of its own model, plan,
data and layout (meshlm.check.shrink builds the replica), against one process."""
