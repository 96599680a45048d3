"""The adapter's SGLang-bound half: what imports SGLang, patches it, or launches it.

The plugin entry point (`plugin.register`), the hooks it installs, the MoE method and the
quantization name SGLang builds, when that method engages, and `kimi-convert serve`. The
engine-neutral modules one folder up (layout, split, completeness, the FlashInfer call and
its kernels) never import this folder; another serving engine would be a sibling folder.
"""
