"""Builders shared by the TensorFlow tests (the `tf` and `keras` fixtures are in conftest.py).

Nothing here imports TensorFlow: every builder takes the module from the fixture, so that a
test process that never asks for it never loads it (``import shardkit`` must not either).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def bits(a: Any) -> tuple[Any, ...]:
    """What a bit-exact comparison compares: dtype, shape and the raw bytes (NaN payloads
    included); the values of an object (string) array."""
    a = np.asarray(a)
    return (a.dtype, a.shape, a.tolist() if a.dtype.kind == "O" else a.tobytes())


def module(tf: Any, **attributes: Any) -> Any:
    """A tf.Module holding `attributes` in their order: tf.Modules and tf.Variables as they
    are, anything else as a tf.Variable of it."""
    root = tf.Module()
    for name, value in attributes.items():
        if not isinstance(value, (tf.Module, tf.Variable)):
            value = tf.Variable(value)
        setattr(root, name, value)
    return root


def keras_model(keras: Any, inputs: int, hidden: int, outputs: int, *,
                activation: str | None = None, seed: int | None = None) -> tuple[Any, Any]:
    """A small Sequential MLP compiled with Adam (learning rate 0.01) on mse, and its
    optimizer, built; `seed` seeds Keras' initializers first."""
    if seed is not None:
        keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((inputs,)),
                              keras.layers.Dense(hidden, activation=activation),
                              keras.layers.Dense(outputs)])
    opt = keras.optimizers.Adam(learning_rate=0.01)
    model.compile(opt, "mse")
    opt.build(model.trainable_variables)
    return model, opt
