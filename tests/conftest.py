import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=30, deadline=None)
settings.register_profile(
    "thorough", max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture(scope="session")
def tf():
    """TensorFlow, imported on first use (never by ``import shardkit``); skips without it."""
    return pytest.importorskip("tensorflow")


@pytest.fixture(scope="session")
def keras(tf):
    """Keras (the one TensorFlow uses), imported on first use; skips without it."""
    return pytest.importorskip("keras")
