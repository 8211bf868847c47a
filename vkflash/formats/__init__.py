"""vkflash.formats"""
