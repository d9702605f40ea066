"""The ingress's choice of cell without Serve: prefix affinity, its load guard, and what it
forgets."""

import random

from deploy.serving.cell_choice import CellChooser
from scheduler.request import Request


def req(prompt):
    return Request("x", prompt, 4)


def test_a_prompt_goes_where_its_longest_known_prefix_went():
    chooser, cells = CellChooser(), ["a", "b", "c"]
    system = list(range(100, 148))  # three full blocks shared by every conversation
    chooser.placed(req(system + [1] * 40), "a")
    chooser.placed(req(system + [2] * 40), "b")
    # the deeper match wins
    assert chooser.choose(req(system + [2] * 40 + [9] * 20), cells, {}) == "b"
    # only the shared part known: its latest cell
    assert chooser.choose(req(system + [3] * 20), cells, {}) == "b"
    # nothing known: the less loaded of two random cells, so never the busiest of three
    random.seed(1)
    picks = {chooser.choose(req([7] * 64), cells, {"a": 5, "b": 1, "c": 3}) for _ in range(50)}
    assert picks == {"b", "c"}


def test_a_busier_cell_loses_its_affinity_and_a_cell_not_running_is_never_chosen_then_forgotten():
    chooser, prompt = CellChooser(imbalance=4), req(list(range(64)))
    chooser.placed(prompt, "a")
    # 4 more open requests: within the guard
    assert chooser.choose(prompt, ["a", "b"], {"a": 9, "b": 5}) == "a"
    # 5 more: the less loaded instead
    assert chooser.choose(prompt, ["a", "b"], {"a": 9, "b": 4}) == "b"
    # a does not run (draining, gone, avoided): never chosen
    assert chooser.choose(prompt, ["b"], {}) == "b"
    chooser.forget("a")
    assert not chooser.owners
    chooser.placed(prompt, "b")
    assert set(chooser.owners.values()) == {"b"}
