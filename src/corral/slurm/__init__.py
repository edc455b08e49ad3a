"""Slurm batch scripts: reading, writing, submitting."""
