"""Support code shared by tests/ and bench/ (bench never imports tests/): reference maths and
model folders. Nothing here runs in the edge or the verifier."""
