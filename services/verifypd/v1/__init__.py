"""Generated protobuf/gRPC stubs of the verifypd.v1 protocol (see proto/generate.py)."""
