"""vkflash.model"""
