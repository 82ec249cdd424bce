"""Parallel strategies: each transforms a plain model (or its parameters) given a device mesh."""
