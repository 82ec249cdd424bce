"""meshlm.data"""
