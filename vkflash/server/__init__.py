"""vkflash.server"""
