"""Lanes: batch executors behind one interface, with in-process and gRPC transports."""
