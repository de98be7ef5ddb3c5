"""ray_app: PyTorch DDP training on Ray Train, from a laptop to a GPU cluster."""

__version__ = "0.1.0"
