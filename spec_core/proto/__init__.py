"""Generated gRPC stubs (scripts/gen_protos.py; do not edit them), and qpayload.py: the q payload
between the wire and spec_core.qcodec, hand-written."""
