"""vkflash.gpu"""
