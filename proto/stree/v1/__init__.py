"""Generated stubs of the ``stree.v1`` protobuf package: regenerate with ``python proto/generate.py``."""
