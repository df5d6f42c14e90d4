"""The client tests' tuned model (tests/clients/model.py): the committed weights follow the current recipe and,
greedy, give every trained form on each prompt the tests send (think + one well-formed Hermes call with either
tool schema, the fixed answer after the tool, the greeting, a grammar-forced call closed in the tests' max_tokens). A failure names each prompt and what the model said;
the fix is a rebuild (`python -m tests.clients.model`), which checks the same before it writes."""

from __future__ import annotations

import json
from pathlib import Path

from tests.clients import model


def test_committed_model_follows_the_recipe() -> None:
    info = json.loads((model.COMMITTED / model.BUILD_INFO).read_text())
    recipe = json.loads(json.dumps(model.recipe()))  # as stored (tuples are lists)
    assert info["recipe"] == recipe, "the recipe changed: rebuild with python -m tests.clients.model"
    assert info["key"] == model.cache_key() and info["problems"] == []


def test_committed_model_gives_every_trained_form() -> None:
    assert model.behaviour_problems(model.COMMITTED) == []


def test_the_check_fails_on_the_untuned_model(tmp_path: Path) -> None:
    """The check can fail: the random tiny model (what the recipe starts from) has none of the forms."""
    from engine.tiny_model import create_tiny_model

    problems = model.behaviour_problems(create_tiny_model(tmp_path / "base", seed=0))
    assert len(problems) == (2 * len(model.CHECK_QUESTIONS) + len(model.CHECK_GREETINGS)
                             + len(model.CLAUDE_CODE_TOOLS) * len(model.CLAUDE_CODE_CHECKS)
                             + len(model.CHECK_FORCED)), problems
