"""The lab's fitting: KV predictors (``inference.lab.kv_prediction``) and early-exit lenses
(``inference.lab.early_exit``), ridge regressions on the reference engine's traces of the lab's
calibration text. The operator runs it (``manage.py bench lab``, ``bench lab-exit``: the lab extra);
a board only loads the files it writes."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from dashboard.lab.texts import calibration_documents
from inference.engine.model_file import ModelFile
from inference.lab.early_exit import ExitLens, _need_torch, torch
from inference.lab.kv_prediction import Predictor, predictor_path


def fit_predictors(
    reference,
    documents: Sequence[Sequence[int]],
    ks: Sequence[int],
    fingerprint: str,
    *,
    ridge: float = 1e-3,
    source: str = "",
    progress: Callable[[int], None] | None = None,
) -> dict[int, Predictor]:
    """Closed-form ridge regression, for each k in ``ks``, of every layer >= k's K (before its
    norm) and V on the auxiliary's last-layer features, over every position of ``documents``
    (token lists, each run from position 0 by the reference engine; one pass serves every k).
    ``ridge`` is relative to the mean feature energy (the diagonal of X'X / n)."""
    import torch

    c = reference.config
    for k in ks:
        if not 1 <= k < c.n_layer:
            raise ValueError(f"k must be between 1 and {c.n_layer - 1}, got {k}")
    e = c.n_head_kv * c.head_dim
    n_features = 2 * e + 1
    xtx = {k: np.zeros((n_features, n_features), np.float64) for k in ks}
    xty = {k: np.zeros((c.n_layer - k, n_features, 2 * e), np.float64) for k in ks}
    total = 0
    for tokens in documents:
        t = reference.forward(list(tokens), logits_at=[], trace=True).trace
        n = len(tokens)
        targets = [
            torch.cat([t.k_raw[layer].reshape(n, e), t.v[layer].reshape(n, e)], dim=1).numpy().astype(np.float64)
            for layer in range(c.n_layer)
        ]
        for k in ks:
            x = np.concatenate(
                [
                    t.k_normed[k - 1].reshape(n, e).numpy(),
                    t.v[k - 1].reshape(n, e).numpy(),
                    np.ones((n, 1), np.float32),
                ],
                axis=1,
            ).astype(np.float64)
            xtx[k] += x.T @ x
            for index, layer in enumerate(range(k, c.n_layer)):
                xty[k][index] += x.T @ targets[layer]
        total += n
        if progress is not None:
            progress(1)
    if total == 0:
        raise ValueError("no calibration tokens")
    rope_base = np.array([c.rope_base_of(layer) for layer in range(c.n_layer)], np.float64)
    predictors = {}
    for k in ks:
        regularizer = ridge * np.trace(xtx[k]) / n_features * np.eye(n_features)
        regularizer[-1, -1] = 0.0  # the bias is not shrunk
        system = xtx[k] + regularizer
        weights = np.stack([np.linalg.solve(system, xty[k][index]) for index in range(c.n_layer - k)]).astype(
            np.float32
        )
        k_norm = np.stack([reference.w(layer, "attn_k_norm").numpy() for layer in range(k, c.n_layer)]).astype(
            np.float32
        )
        predictors[k] = Predictor(
            fingerprint,
            k,
            c.n_layer,
            c.n_head_kv,
            c.head_dim,
            c.rms_eps,
            rope_base,
            weights,
            k_norm,
            {
                "source": source,
                "documents": len(documents),
                "tokens": int(total),
                "ridge": ridge,
                "method": "ridge regression (closed form)",
            },
        )
    return predictors


def ensure_predictors(
    model: ModelFile,
    ks: Sequence[int],
    directory: str | Path,
    tokenize: Callable[[str], list[int]],
    *,
    threads: int = 0,
    max_documents: int | None = None,
    progress=None,
    reference=None,
) -> dict[int, Path]:
    """The predictor file for each k, fitted (with the reference engine, on the lab's calibration
    text) for those that do not exist yet. Needs the lab extra when any is missing."""
    paths = {k: predictor_path(directory, model.sha256, k) for k in ks}
    missing = [k for k, path in paths.items() if not path.exists()]
    if missing:
        from inference.lab.reference import ReferenceModel  # lazy: the reference engine needs the lab extra (torch)

        reference = reference or ReferenceModel.load(model.path, threads=threads)
        documents = calibration_documents(tokenize)
        if max_documents is not None:
            documents = documents[:max_documents]
        fitted = fit_predictors(
            reference,
            documents,
            missing,
            model.sha256,
            source="MMLU calibration questions (dashboard.lab.texts)",
            progress=progress,
        )
        for k, predictor in fitted.items():
            predictor.save(paths[k])
    return paths


def fit_lens(
    reference,
    documents: Sequence[Sequence[int]],
    depths: Sequence[int],
    fingerprint: str,
    *,
    ridge: float = 1e-2,
    source: str = "",
    progress=None,
) -> ExitLens:
    """Closed-form ridge regression, per depth, of (last residual - residual at depth) on
    [residual at depth, 1], over every position of ``documents`` (each run from position 0).
    ``ridge`` is relative to the mean feature energy; the bias is not shrunk."""
    _need_torch()
    c = reference.config
    if not depths or any(not 1 <= d < c.n_layer for d in depths):
        raise ValueError(f"exit depths must be between 1 and {c.n_layer - 1}, got {list(depths)}")
    size = c.n_embd + 1
    xtx = {d: torch.zeros(size, size, dtype=torch.float64) for d in depths}
    xty = {d: torch.zeros(size, c.n_embd, dtype=torch.float64) for d in depths}
    total = 0
    for tokens in documents:
        hidden = reference.forward(list(tokens), logits_at=[], trace=True).trace.hidden
        last = hidden[c.n_layer].double()
        ones = torch.ones(len(tokens), 1, dtype=torch.float64)
        for d in depths:
            x = torch.cat([hidden[d].double(), ones], dim=1)
            xtx[d] += x.T @ x
            xty[d] += x.T @ (last - hidden[d].double())
        total += len(tokens)
        if progress is not None:
            progress(1)
    if total == 0:
        raise ValueError("no calibration tokens")
    weights = {}
    for d in depths:
        regularizer = ridge * torch.trace(xtx[d]) / size * torch.eye(size, dtype=torch.float64)
        regularizer[-1, -1] = 0.0
        weights[d] = torch.linalg.solve(xtx[d] + regularizer, xty[d]).float().numpy()
    return ExitLens(
        fingerprint,
        weights,
        {
            "source": source,
            "documents": len(documents),
            "tokens": total,
            "ridge": ridge,
            "method": "ridge regression (closed form) to the last layer's residual stream",
        },
    )
