"""Head training in numpy: softmax regression on a frozen backbone's features.

With the backbone frozen, fine-tuning the head is a linear softmax model on fixed features ``[N, F]``:
the cross-entropy's gradient is closed-form, so numpy alone trains it, on any device that runs
inference (ONNX Runtime, Pillow, numpy), without the deprecated ``onnxruntime-training`` package.

The updates are those of ONNX Runtime training's head graphs, so both backends train the same model
from the same seed (tested against each other):

- loss: mean cross-entropy over the mini-batch;
- ``sgd``: ``p -= lr * g`` (no momentum, no weight decay);
- ``adamw``: ONNX Runtime's ``AdamWOptimizer`` in its default mode (Hugging Face's AdamW): betas
  0.9 and 0.999, eps 1e-6, bias correction, no weight decay.

Mini-batches are drawn from ``numpy.random.default_rng(seed)``, one permutation per epoch.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

BETA1, BETA2, EPS = 0.9, 0.999, 1e-6


def loss_and_grad(feats: np.ndarray, labels: np.ndarray, w: np.ndarray, b: np.ndarray
                  ) -> tuple[float, np.ndarray, np.ndarray]:
    """Mean cross-entropy of ``feats @ w.T + b`` against ``labels`` and its gradients ``(dw, db)``."""
    x = feats.astype(np.float64)
    z = x @ w.T.astype(np.float64) + b.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    n = len(labels)
    loss = -float(log_p[np.arange(n), labels].mean())
    dz = np.exp(log_p)
    dz[np.arange(n), labels] -= 1.0
    dz /= n
    return loss, (dz.T @ x).astype(np.float32), dz.sum(axis=0).astype(np.float32)


class _AdamW:
    def __init__(self, params: list[np.ndarray], lr: float) -> None:
        self.lr, self.step_count = lr, 0
        self.m = [np.zeros_like(p) for p in params]
        self.v = [np.zeros_like(p) for p in params]

    def step(self, params: list[np.ndarray], grads: list[np.ndarray]) -> None:
        self.step_count += 1
        t = self.step_count
        size = self.lr * np.sqrt(1.0 - BETA2 ** t) / (1.0 - BETA1 ** t)
        for p, g, m, v in zip(params, grads, self.m, self.v):
            m *= BETA1
            m += (1.0 - BETA1) * g
            v *= BETA2
            v += (1.0 - BETA2) * g * g
            p -= (size * m / (np.sqrt(v) + EPS)).astype(p.dtype)


class _SGD:
    def __init__(self, params: list[np.ndarray], lr: float) -> None:
        self.lr = lr

    def step(self, params: list[np.ndarray], grads: list[np.ndarray]) -> None:
        for p, g in zip(params, grads):
            p -= (self.lr * g).astype(p.dtype)


def run_epochs(step: Callable[[np.ndarray], float], n: int, *, epochs: int, batch: int, seed: int) -> list[float]:
    """Call ``step(indices)`` on shuffled mini-batches of ``range(n)`` (one permutation per epoch from
    ``default_rng(seed)``: every backend sees the same batches); ``step`` returns the batch's mean loss.
    Returns the mean loss of each epoch."""
    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(epochs):
        order = rng.permutation(n)
        total = 0.0
        for i in range(0, n, batch):
            idx = order[i:i + batch]
            total += step(idx) * len(idx)
        losses.append(total / n)
    return losses


def train_head(feats: np.ndarray, labels: np.ndarray, w: np.ndarray, b: np.ndarray, *, epochs: int, lr: float,
               batch: int, optimizer: str, seed: int) -> tuple[np.ndarray, np.ndarray, list[float]]:
    """Train the head ``(w [C, F], b [C])`` on ``feats [N, F]``; returns the new ``(w, b)`` and the
    mean training loss of each epoch. The inputs are not modified."""
    w, b = w.astype(np.float32).copy(), b.astype(np.float32).copy()
    params = [w, b]
    opt = {"adamw": _AdamW, "sgd": _SGD}[optimizer](params, lr)

    def step(idx: np.ndarray) -> float:
        loss, dw, db = loss_and_grad(feats[idx], labels[idx], w, b)
        opt.step(params, [dw, db])
        return loss

    losses = run_epochs(step, len(labels), epochs=epochs, batch=batch, seed=seed)
    return w, b, losses
