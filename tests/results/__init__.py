"""Finished results and their acknowledgement."""
