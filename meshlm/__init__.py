"""meshlm: train Llama-style decoders with data, ZeRO, tensor and pipeline parallelism on one device mesh."""

__version__ = "0.1.0"
