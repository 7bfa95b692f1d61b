"""A lexical view of prompt injection, beside the MiniLM head: character n-grams (2 to 5 characters
within word boundaries, lower-cased), hashed into 2^20 columns, sublinear TF-IDF, l2-normalised, and a
logistic regression over them. It reads spellings, markup and phrasings ("ignore", "DAN", "###
instruction") that a 384-dimensional sentence embedding smooths away.

Served without pickle: the hashing is scikit-learn's `HashingVectorizer` (stateless, its settings are
here), and the learnt part is three arrays in the injection npz (`lex_columns`, `lex_idf`,
`lex_coef`) and a bias (`lex_b`). `fit` is the training half (`train_injection.py`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

N_FEATURES = 2**20
KEYS = ("lex_columns", "lex_idf", "lex_coef", "lex_b")


@functools.cache
def _vectorizer():  # type: ignore[no-untyped-def]
    from sklearn.feature_extraction.text import HashingVectorizer

    return HashingVectorizer(
        analyzer="char_wb", ngram_range=(2, 5), n_features=N_FEATURES, alternate_sign=False, norm=None, dtype=np.float32
    )


def _counts(texts: list[str]):  # type: ignore[no-untyped-def]
    return _vectorizer().transform(texts)


@dataclass(frozen=True)
class LexicalModel:
    columns: np.ndarray  # int32: the hashed n-gram columns in the vocabulary (df >= min_df, most frequent)
    idf: np.ndarray  # float32, per column
    coef: np.ndarray  # float32, per column
    bias: float

    def __post_init__(self) -> None:
        idf, coef = np.zeros(N_FEATURES, np.float32), np.zeros(N_FEATURES, np.float32)
        idf[self.columns], coef[self.columns] = self.idf, self.coef
        object.__setattr__(self, "_idf", idf)  # dense lookups: a text's n-grams index them directly
        object.__setattr__(self, "_coef", coef)

    def features(self, texts: list[str]):  # type: ignore[no-untyped-def]
        """Sparse rows: (1 + log count) x idf over the vocabulary, l2-normalised (TfidfVectorizer's
        sublinear_tf, smooth_idf and norm="l2"); an n-gram outside the vocabulary weighs nothing."""
        x = _counts(texts)
        x.data = (1.0 + np.log(x.data)) * self._idf[x.indices]  # type: ignore[attr-defined]
        norms = np.sqrt(np.asarray(x.multiply(x).sum(axis=1)).ravel())
        scale = np.divide(1.0, norms, out=np.zeros_like(norms), where=norms > 0)
        x.data *= np.repeat(scale, np.diff(x.indptr)).astype(np.float32)
        x.eliminate_zeros()
        return x

    def logits(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros(0)
        return np.asarray(self.features(texts) @ self._coef, dtype=np.float64) + self.bias  # type: ignore[attr-defined]

    def shifted(self, shift: float) -> LexicalModel:
        return LexicalModel(self.columns, self.idf, self.coef, self.bias + shift)

    def arrays(self) -> dict[str, np.ndarray]:
        return dict(zip(KEYS, (self.columns, self.idf, self.coef, np.float32(self.bias))))

    @classmethod
    def from_arrays(cls, data) -> LexicalModel | None:  # type: ignore[no-untyped-def]
        """From an npz (or dict) holding KEYS; None when it holds none of them."""
        if KEYS[0] not in data:
            return None
        return cls(data["lex_columns"].astype(np.int32), data["lex_idf"].astype(np.float32),
                   data["lex_coef"].astype(np.float32), float(data["lex_b"]))


def fit(texts: list[str], labels: np.ndarray, *, min_df: int = 3, max_features: int = 200_000, c: float = 4.0,
        weights: np.ndarray | None = None) -> LexicalModel:
    """The vocabulary (n-grams in at least `min_df` texts, the `max_features` most frequent), the idf
    and a class-balanced logistic regression (`weights` multiply rows' weights), all from the training
    texts."""
    from sklearn.linear_model import LogisticRegression

    counts = _counts(texts)
    df = np.bincount(counts.indices, minlength=N_FEATURES)  # each row lists a column once
    total = np.asarray(counts.sum(axis=0)).ravel()
    frequent = np.flatnonzero(df >= min_df)
    columns = np.sort(frequent[np.argsort(-total[frequent], kind="stable")[:max_features]]).astype(np.int32)
    idf = (np.log((1 + len(texts)) / (1 + df[columns])) + 1.0).astype(np.float32)
    vocabulary = LexicalModel(columns, idf, np.zeros(len(columns), np.float32), 0.0)
    x = vocabulary.features(texts)[:, columns]
    model = LogisticRegression(C=c, class_weight="balanced", max_iter=2000).fit(x, labels, sample_weight=weights)
    return LexicalModel(columns, idf, model.coef_[0].astype(np.float32), float(model.intercept_[0]))
