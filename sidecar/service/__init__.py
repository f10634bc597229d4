"""The running sidecar: config to app, the gRPC server and its lifecycle, reload, admin, CLIs."""
