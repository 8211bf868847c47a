"""vkflash: a Python-driven Vulkan inference engine for Qwen3.8-Flash-Next and its ancestors."""

__version__ = "0.1.0"
