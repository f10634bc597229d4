"""Priority carried into the engine's body field: parsing, ranks, rewriting."""
import pytest

from sidecar.engine_priority import VLLM, EngineField, class_ranks, engine_field, rewrite

DYNAMO = EngineField(("nvext", "agent_hints", "priority"), higher_first=True)


@pytest.mark.parametrize("kind, field, higher_first, expected", [
    ("", "", False, None),
    ("none", "", False, None),
    ("vllm", "", False, VLLM),
    ("field", "nvext.agent_hints.priority", True, DYNAMO),
])
def test_engine_field_from_settings(kind, field, higher_first, expected):
    assert engine_field(kind, field, higher_first) == expected


@pytest.mark.parametrize("kind, field", [("sglang", ""), ("field", ""), ("field", "a..b")])
def test_bad_engine_settings_name_the_field(kind, field):
    with pytest.raises(ValueError, match="engine_priority"):
        engine_field(kind, field)


def test_ranks_default_to_the_class_order_and_take_the_routes_mapping():
    classes = ("vip", "standard", "batch")
    assert class_ranks(classes, {}) == {"vip": 0, "standard": 1, "batch": 2}
    assert class_ranks(classes, {"batch": 10}) == {"vip": 0, "standard": 1, "batch": 10}
    with pytest.raises(ValueError, match="gold"):
        class_ranks(classes, {"gold": 0})


@pytest.mark.parametrize("field, rank, expected", [(VLLM, 0, 0), (VLLM, 2, 2), (DYNAMO, 0, 2), (DYNAMO, 2, 0)])
def test_the_value_follows_the_engines_polarity(field, rank, expected):
    assert field.value(rank, max_rank=2) == expected


def test_the_clients_values_are_stripped_and_the_chosen_field_written():
    body = {"model": "m", "priority": -100, "nvext": {"agent_hints": {"priority": 99, "latency": 1}}}
    assert rewrite(body, [VLLM, DYNAMO], DYNAMO, 2)
    assert body == {"model": "m", "nvext": {"agent_hints": {"priority": 2, "latency": 1}}}


def test_a_field_on_a_path_that_is_not_an_object_is_replaced_and_nothing_else_changes():
    body = {"model": "m", "nvext": "junk"}
    assert rewrite(body, [DYNAMO], DYNAMO, 1)
    assert body == {"model": "m", "nvext": {"agent_hints": {"priority": 1}}}
    untouched = {"model": "m"}
    assert not rewrite(untouched, [VLLM], None, None) and untouched == {"model": "m"}
