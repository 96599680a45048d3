"""kimi-w31: Kimi-K3 MXFP4 checkpoints in the fused [up; gate] expert layout."""

__version__ = "0.1.0"
