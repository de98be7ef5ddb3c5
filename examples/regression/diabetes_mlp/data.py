"""scikit-learn's diabetes data set (442 patients, 10 features), standardized.

`load_diabetes()` reads a file inside the scikit-learn wheel: no download,
the same on every worker.
"""

import math

import torch
from sklearn.datasets import load_diabetes
from torch.utils.data import TensorDataset


def build(eval_fraction: float = 0.2, seed: int = 0):
    """Return `(train, eval, info)`; items are `(x: FloatTensor[10], y: FloatTensor[1])`.

    The split is a fixed permutation from `seed` (the same on every worker).
    Features and target are standardized with the train split's mean and
    std, so eval MSE is in units of the target's variance (1.0 = predicting
    the mean); multiply a prediction by `info["target_std"]` and add
    `info["target_mean"]` to get the disease-progression score back.
    """
    x, y = load_diabetes(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.float32).unsqueeze(1)  # [N, 1], the shape of the model's output

    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    # ceil: with the defaults 89 eval samples, odd and not a multiple of 3,
    # so the kit's distributed sampler has to pad (and drop the padding).
    n_eval = math.ceil(len(x) * eval_fraction)
    eval_idx, train_idx = perm[:n_eval], perm[n_eval:]

    x_mean, x_std = x[train_idx].mean(0), x[train_idx].std(0)
    y_mean, y_std = y[train_idx].mean(), y[train_idx].std()
    x = (x - x_mean) / x_std
    y = (y - y_mean) / y_std

    train = TensorDataset(x[train_idx], y[train_idx])
    eval_ = TensorDataset(x[eval_idx], y[eval_idx])
    info = {"in_features": x.shape[1], "target_mean": y_mean.item(), "target_std": y_std.item()}
    return train, eval_, info
