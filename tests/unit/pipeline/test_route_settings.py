import pytest
from envoy.config.core.v3 import base_pb2
from google.protobuf import struct_pb2, text_format

from sidecar.route_settings import (RouteSettingsError, metadata_from_attribute,
                                    parse_route_settings, settings_from_attribute)


def envoy_attribute(sluice: dict) -> str:
    """route metadata as Envoy 1.40 sends it: the text format of core.v3.Metadata."""
    metadata = base_pb2.Metadata()
    struct = struct_pb2.Struct()
    struct.update(sluice)
    metadata.filter_metadata["sluice"].CopyFrom(struct)
    return text_format.MessageToString(metadata, as_one_line=True)


def test_parses_candidates_from_envoy_attribute():
    settings = settings_from_attribute(envoy_attribute(
        {"name": "chat", "candidates": [{"cluster": "a", "weight": 3}, {"cluster": "b"}]}))
    assert settings.name == "chat"
    assert [(c.cluster, c.HasField("weight"), c.weight) for c in settings.candidates] == [
        ("a", True, 3.0), ("b", False, 0.0)]


def test_other_namespaces_are_ignored():
    metadata = base_pb2.Metadata()
    metadata.filter_metadata["other"].update({"x": 1})
    assert metadata_from_attribute(text_format.MessageToString(metadata)) is None


@pytest.mark.parametrize("sluice, field", [
    ({"candidate": []}, "candidate"),
    ({"candidates": [{"cluster": "a", "weight": "heavy"}]}, "weight"),
    ({"candidates": [{"cluster": "a", "weight": -1}]}, "candidates[0].weight"),
    ({"candidates": [{"weight": 1}]}, "candidates[0].cluster"),
    ({"candidates": "a"}, "candidates"),
])
def test_bad_settings_name_the_field(sluice, field):
    with pytest.raises(RouteSettingsError, match=field.replace("[", r"\[").replace("]", r"\]")):
        parse_route_settings(sluice)


def test_bad_attribute_is_returned_as_error_not_raised():
    result = settings_from_attribute(envoy_attribute({"candidates": [{"cluster": "a", "weight": -2}]}))
    assert isinstance(result, RouteSettingsError)
    assert isinstance(settings_from_attribute("not { text format"), RouteSettingsError)
