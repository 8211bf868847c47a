"""User-facing errors: one clear line, no traceback unless --debug.

Every error a user can cause (bad file, bad knob, bad request) raises a subclass of
VkflashError; the CLI prints `error: <message>` and exits non-zero.
"""


class VkflashError(Exception):
    """Base of all errors whose message is meant for the user as-is."""


def one_line(text: str) -> str:
    """`text` with line breaks and other control characters escaped: file contents quoted in a message
    (a token, a third-party library's message about it) must not break the message's one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class FormatError(VkflashError):
    """A GGUF file is malformed, truncated, or uses something we do not support."""


class ModelError(VkflashError):
    """Hyper-parameters or tensors do not match the model contract (MODEL.md)."""


class ConfigError(VkflashError):
    """A knob or CLI flag has a value we cannot accept."""


class DeviceError(VkflashError):
    """The Vulkan device is missing, lacks a required feature, or was lost."""


class NumericFault(VkflashError):
    """The forward produced NaN or +inf logits: damaged weights or an f32 overflow, never a token."""


class DoesNotFit(VkflashError):
    """A configuration or a step needs more memory than the budget (VKFLASH_MEM_BUDGET or the device's)."""
