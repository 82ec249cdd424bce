"""meshlm.checkpoint"""
