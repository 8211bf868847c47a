"""Reference layer math (MODEL.md §5), one module per op family, written like the equations."""
