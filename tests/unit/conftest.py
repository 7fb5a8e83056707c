"""Shared fixtures for the DSV4 model tests: tiny checkpoints (written once per session) and our
model loaded from them. Tests that mutate a model must build their own."""

import pytest

from sglang_dsv4_ascend.models.weights import load_model_from_dir


@pytest.fixture(scope="session")
def tiny_ckpt(tiny_checkpoint):
    """preset -> checkpoint dir (flash / pro, NextN draft; tests/conftest.py writes it once)."""
    return lambda preset: tiny_checkpoint(preset, "nextn")


@pytest.fixture(scope="session")
def dsv4_model(tiny_ckpt):
    """preset -> our fp32 DSV4Model (shared, do not mutate)."""
    models = {}

    def get(preset):
        if preset not in models:
            models[preset] = load_model_from_dir(tiny_ckpt(preset))
        return models[preset]

    return get
