"""corral: run an unchanged PyTorch training script on every machine you can SSH into."""

__version__ = "0.1.0"
