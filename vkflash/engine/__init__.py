"""vkflash.engine"""
