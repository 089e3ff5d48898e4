"""Finished results and their acknowledgement (issue 18)."""
