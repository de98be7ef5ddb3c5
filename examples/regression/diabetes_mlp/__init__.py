"""An MLP on scikit-learn's diabetes data: a user project for ray_app (plain PyTorch)."""
