"""The one import point for our generated protobuf modules (built by `make proto`)."""
import sidecar.gen  # noqa: F401  (puts the generated tree on sys.path)

from sluice.v1 import admin_pb2, admin_pb2_grpc, route_settings_pb2  # noqa: E402

__all__ = ["admin_pb2", "admin_pb2_grpc", "route_settings_pb2"]
