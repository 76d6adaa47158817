"""Seed derivation: the one way iapo-gym turns a root seed and keys into child seeds.

Every derived seed goes through ``numpy.random.SeedSequence``, so runs are bit-identical
whatever the number or kind of worker processes that execute them.
"""

from __future__ import annotations

import hashlib

import numpy as np


def _key_to_int(key: int | str) -> int:
    if isinstance(key, (bool, np.bool_)):
        raise TypeError(f"seed keys must be int or str, got {key!r}")
    if isinstance(key, (int, np.integer)):
        if key < 0:
            raise ValueError(f"seed keys must be >= 0, got {key}")
        return int(key)
    if isinstance(key, str):
        return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    raise TypeError(f"seed keys must be int or str, got {type(key).__name__} {key!r}")


def seed_sequence(root: int, *keys: int | str) -> np.random.SeedSequence:
    """The SeedSequence of ``root`` spawned along ``keys`` (ints, or strings hashed stably)."""
    return np.random.SeedSequence(_key_to_int(root), spawn_key=tuple(_key_to_int(k) for k in keys))


def derive_seed(root: int, *keys: int | str) -> int:
    """A 63-bit integer seed for the child of ``root`` named by ``keys``."""
    return int(seed_sequence(root, *keys).generate_state(2, np.uint32).view(np.uint64)[0] >> np.uint64(1))


def derive_rng(root: int, *keys: int | str) -> np.random.Generator:
    """A fresh PCG64 Generator for the child of ``root`` named by ``keys``."""
    return np.random.default_rng(seed_sequence(root, *keys))
