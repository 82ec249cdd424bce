"""meshlm.observe"""
