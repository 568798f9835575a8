"""Synthetic states for the I/O benchmarks: an LLM-like state and a many-small-tensors state.

Every tensor is its own allocation (as in a real model), filled in place with pseudo-random
values so that no temporary doubles the memory while the state is built.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _filled(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any = np.float32):
    a = np.empty(shape, dtype=dtype)
    if a.size:
        rng.random(out=a.reshape(-1), dtype=a.dtype)
    return a


def llm_state(
    hidden: int = 1024, layers: int = 24, vocab: int = 32000, seed: int = 0
) -> dict[str, Any]:
    """Embedding + `layers` transformer blocks + LM head, float32.

    The defaults give about 1.5 GB (368 M parameters): embedding and head of 32000 x 1024, and
    per layer q/k/v/o (1024 x 1024), an MLP (1024 x 4096 and back), two norms and biases.
    """
    rng = np.random.default_rng(seed)
    h, f = hidden, 4 * hidden
    state: dict[str, Any] = {"embed": {"weight": _filled(rng, (vocab, h))}, "layers": {}}
    for i in range(layers):
        state["layers"][str(i)] = {
            "attn": {n: {"weight": _filled(rng, (h, h)), "bias": _filled(rng, (h,))}
                     for n in ("q", "k", "v", "o")},
            "mlp": {"up": {"weight": _filled(rng, (h, f)), "bias": _filled(rng, (f,))},
                    "down": {"weight": _filled(rng, (f, h)), "bias": _filled(rng, (h,))}},
            "norm1": {"scale": _filled(rng, (h,))},
            "norm2": {"scale": _filled(rng, (h,))},
        }
    state["final_norm"] = {"scale": _filled(rng, (h,))}
    state["lm_head"] = {"weight": _filled(rng, (vocab, h))}
    return state


def many_small_state(count: int = 50_000, total_bytes: int = 200_000_000, seed: int = 0):
    """`count` float32 tensors of random sizes (1-d and 2-d) adding up to about `total_bytes`."""
    rng = np.random.default_rng(seed)
    mean = total_bytes / count / 4
    sizes = np.maximum(1, rng.integers(1, int(2 * mean), count))
    state: dict[str, Any] = {}
    for i, n in enumerate(sizes.tolist()):
        shape = (n,) if i % 2 else (1, n)
        state.setdefault(f"group{i // 1000}", {})[f"t{i}"] = _filled(rng, shape)
    return state


def nbytes(flat: dict[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in flat.values())


WORKLOADS = {
    "llm": (llm_state, {}),
    "many-small": (many_small_state, {}),
}
QUICK = {
    "llm": (llm_state, {"hidden": 256, "layers": 24}),  # ~140 MB
    "many-small": (many_small_state, {"count": 10_000, "total_bytes": 40_000_000}),
}
