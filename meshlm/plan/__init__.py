"""meshlm.plan"""
