"""`vkflash bench`: measurements reported as ratios against a measured ceiling (copy bandwidth, matmul peak)."""
