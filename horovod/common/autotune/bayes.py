"""Bayesian optimisation with a Gaussian process, in NumPy only. PURE.

Maximises an unknown, noisy function on the unit cube ``[0, 1]^d``: a Gaussian process with a
squared-exponential kernel models the scores seen so far (standardised), and the next point is the
candidate with the largest expected improvement. Candidates are random points of the cube plus
perturbations of the best point, drawn from a seeded generator, so a run is reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["GaussianProcess", "BayesianOptimizer", "expected_improvement", "normal_cdf"]


def normal_cdf(z: np.ndarray) -> np.ndarray:
    """The standard normal CDF (erf by Abramowitz & Stegun 7.1.26, error below 1.5e-7)."""
    x = np.abs(z) / math.sqrt(2.0)
    t = 1.0 / (1.0 + 0.3275911 * x)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    erf = 1.0 - poly * np.exp(-x * x)
    return 0.5 * (1.0 + np.sign(z) * erf)


def _normal_pdf(z: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)


class GaussianProcess:
    """GP regression with an RBF kernel of one length scale; ``noise`` is added to the diagonal."""

    def __init__(self, length_scale: float = 0.3, noise: float = 0.8) -> None:
        self.length_scale = length_scale
        self.noise = max(noise, 1e-6)
        self._x: np.ndarray = np.zeros((0, 0))
        self._alpha = np.zeros(0)
        self._chol: np.ndarray = np.zeros((0, 0))
        self._mean = 0.0
        self._std = 1.0

    def _kernel(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        d2 = ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)
        return np.exp(-0.5 * d2 / self.length_scale ** 2)

    def fit(self, x: np.ndarray, y: np.ndarray) -> None:
        """Condition on points ``x`` (n, d) with scores ``y`` (n,)."""
        self._x = np.asarray(x, np.float64)
        y = np.asarray(y, np.float64)
        self._mean = float(y.mean())
        self._std = float(y.std()) or 1.0
        k = self._kernel(self._x, self._x) + self.noise * np.eye(len(y))
        self._chol = np.linalg.cholesky(k)
        z = (y - self._mean) / self._std
        self._alpha = np.linalg.solve(self._chol.T, np.linalg.solve(self._chol, z))

    def predict(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(mean, standard deviation) of the standardised score at points ``x`` (m, d)."""
        ks = self._kernel(np.asarray(x, np.float64), self._x)
        mu = ks @ self._alpha
        v = np.linalg.solve(self._chol, ks.T)
        var = np.clip(1.0 - (v * v).sum(0), 1e-12, None)
        return mu, np.sqrt(var)

    def standardise(self, y: float) -> float:
        return (y - self._mean) / self._std


def expected_improvement(mu: np.ndarray, sigma: np.ndarray, best: float, xi: float = 0.01) -> np.ndarray:
    """Expected improvement over ``best`` of a Gaussian with mean ``mu`` and deviation ``sigma``."""
    gain = mu - best - xi
    z = gain / sigma
    return gain * normal_cdf(z) + sigma * _normal_pdf(z)


class BayesianOptimizer:
    """Suggests points of ``[0, 1]^dims`` to try: the given initial points first, then by EI."""

    def __init__(self, dims: int, initial: Sequence[Sequence[float]] = (), noise: float = 0.8,
                 seed: int = 0, candidates: int = 2048) -> None:
        self.dims = dims
        self._initial = [np.clip(np.asarray(p, np.float64), 0.0, 1.0) for p in initial]
        self._rng = np.random.default_rng(seed)
        self._gp = GaussianProcess(noise=noise)
        self._candidates = candidates
        self.xs: list[np.ndarray] = []
        self.ys: list[float] = []

    def add(self, x: Sequence[float], score: float) -> None:
        self.xs.append(np.asarray(x, np.float64))
        self.ys.append(float(score))

    def best(self) -> tuple[np.ndarray, float]:
        i = int(np.argmax(self.ys))
        return self.xs[i], self.ys[i]

    def best_estimate(self) -> tuple[np.ndarray, float]:
        """The measured point the model rates best (its posterior mean), and its measured score.

        Scores are noisy: the single highest measurement is often a lucky one. The point whose
        smoothed (posterior mean) score is highest is the better pick to keep.
        """
        if len(self.xs) < 3:
            return self.best()
        x = np.stack(self.xs)
        self._gp.fit(x, np.asarray(self.ys))
        mu, _ = self._gp.predict(x)
        i = int(np.argmax(mu))
        return self.xs[i], self.ys[i]

    def suggest(self) -> np.ndarray:
        """The next point to measure."""
        n = len(self.xs)
        if n < len(self._initial):
            return self._initial[n]
        if n < 2:
            return self._rng.random(self.dims)
        x = np.stack(self.xs)
        self._gp.fit(x, np.asarray(self.ys))
        best_x, best_y = self.best()
        local = np.clip(best_x + 0.1 * self._rng.standard_normal((self._candidates // 4, self.dims)), 0.0, 1.0)
        cand = np.concatenate([self._rng.random((self._candidates, self.dims)), local])
        mu, sigma = self._gp.predict(cand)
        ei = expected_improvement(mu, sigma, self._gp.standardise(best_y))
        return cand[int(np.argmax(ei))]
