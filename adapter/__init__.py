"""The serving side. Engine-neutral modules sit here; each serving engine has its own folder
(`sglang/`) that may use them, never the other way round (tests/test_architecture.py)."""
