"""Pictures the lessons draw: one module per lesson that needs more than a few lines of matplotlib."""
