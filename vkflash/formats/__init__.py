"""vkflash.formats: GGUF reading/writing and the GGML block formats.

The lowest layer: depends only on numpy and gguf; everything else may import it. gguf.quants
decodes every type and encodes those it can; vkflash.formats.quantizers encodes the rest.
"""

from vkflash.formats.gguf_file import GGUFFile, Metadata, TensorInfo
from vkflash.formats.gguf_write import FloatTensor, RawTensor, Typed, write_gguf
from vkflash.formats.quants import BLOCK, SCALE_FIELDS, dequantize, quantize, random_blocks, row_bytes

__all__ = [
    "GGUFFile", "Metadata", "TensorInfo",
    "FloatTensor", "RawTensor", "Typed", "write_gguf",
    "BLOCK", "SCALE_FIELDS", "dequantize", "quantize", "random_blocks", "row_bytes",
]
