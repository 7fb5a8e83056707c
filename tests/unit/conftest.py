"""Shared fixtures for the DSV4 model tests: tiny checkpoints (written once per session) and our
model loaded from them. Tests that mutate a model must build their own."""

import pytest

from sglang_dsv4_ascend.models.weights import load_model_from_dir
from sglang_dsv4_ascend.tools.make_tiny_checkpoint import write_checkpoint


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """preset -> checkpoint dir (flash / pro, NextN draft)."""
    dirs = {}

    def get(preset):
        if preset not in dirs:
            dirs[preset] = write_checkpoint(str(tmp_path_factory.mktemp(f"dsv4_{preset}")), preset, "nextn")
        return dirs[preset]

    return get


@pytest.fixture(scope="session")
def dsv4_model(tiny_ckpt):
    """preset -> our fp32 DSV4Model (shared, do not mutate)."""
    models = {}

    def get(preset):
        if preset not in models:
            models[preset] = load_model_from_dir(tiny_ckpt(preset))
        return models[preset]

    return get

