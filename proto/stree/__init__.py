"""Generated protobuf/gRPC stubs (package ``stree``; see proto/generate.py)."""
