"""Generate docs/route-settings.md from proto/sluice/v1/route_settings.proto (its comments are
the documentation), so the reference page and the code cannot drift. `--check` fails when the
committed page is stale (a test runs it)."""
from __future__ import annotations

import pathlib
import sys
import tempfile

import grpc_tools
from google.protobuf import descriptor_pb2
from grpc_tools import protoc

from docs_page import write_or_check  # scripts/docs_page.py

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO = "sluice/v1/route_settings.proto"
OUT = ROOT / "docs" / "route-settings.md"
TYPES = {1: "double", 2: "float", 3: "int64", 4: "uint64", 5: "int32", 8: "bool", 9: "string",
         13: "uint32", 14: "enum"}


def descriptor() -> descriptor_pb2.FileDescriptorProto:
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "set.pb"
        include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
        rc = protoc.main(["protoc", f"-I{ROOT / 'proto'}", f"-I{include}", "--include_source_info",
                          f"--descriptor_set_out={out}", PROTO])
        if rc != 0:
            raise SystemExit("protoc failed")
        files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    return next(f for f in files.file if f.name == PROTO)


def comments(file: descriptor_pb2.FileDescriptorProto) -> dict[tuple, str]:
    found = {}
    for location in file.source_code_info.location:
        text = " ".join(line.strip() for line in location.leading_comments.strip().splitlines())
        if text:
            found[tuple(location.path)] = text
    return found


def field_type(field: descriptor_pb2.FieldDescriptorProto, file) -> str:
    if field.type == 11:    # message
        name = field.type_name.rsplit(".", 1)[-1]
        entry = next((m for m in file.message_type for n in m.nested_type if n.name == name), None)
        if name.endswith("Entry") and entry is not None:
            return "map<string, double>"
        return f"[{name}](#{name.lower()})"
    kind = TYPES.get(field.type, "?")
    return f"repeated {kind}" if field.label == 3 else kind


def render() -> str:
    file = descriptor()
    docs = comments(file)
    lines = ["# Per-route settings reference", "",
             "Generated from `proto/sluice/v1/route_settings.proto` by `scripts/gen_route_docs.py`; "
             "do not edit by hand. SREs write these under `metadata.filter_metadata.sluice` of an "
             "Envoy route (snake_case or lowerCamelCase keys). Defaults are in each description.", ""]
    for index, message in enumerate(file.message_type):
        lines += [f"## {message.name}", "", docs.get((4, index), ""), "",
                  "| field | type | meaning and default |", "|---|---|---|"]
        for number, field in enumerate(message.field):
            if field.type == 11 and field.label == 3 and field.type_name.endswith("Entry"):
                kind = "map<string, double>"
            elif field.type == 11 and field.label == 3:
                kind = "repeated " + field_type(field, file)
            else:
                kind = field_type(field, file)
            text = docs.get((4, index, 2, number), "").replace("|", "\\|")
            lines.append(f"| `{field.name}` | {kind} | {text} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    return write_or_check(OUT, render(), ROOT)


if __name__ == "__main__":
    sys.exit(main())
