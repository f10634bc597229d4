import subprocess
import sys

from devtools.stack import ROOT


def test_route_settings_reference_is_generated_from_the_proto():
    result = subprocess.run([sys.executable, "scripts/gen_route_docs.py", "--check"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_reference_documents_every_field():
    from sidecar.protos import route_settings_pb2 as pb
    text = (ROOT / "docs" / "route-settings.md").read_text()
    for message in (pb.RouteSettings, pb.Candidate, pb.Scheduling, pb.Breaker, pb.Timeout, pb.Cache, pb.Admission):
        assert f"## {message.DESCRIPTOR.name}" in text
        for field in message.DESCRIPTOR.fields:
            assert f"| `{field.name}` |" in text, f"{message.DESCRIPTOR.name}.{field.name}"
