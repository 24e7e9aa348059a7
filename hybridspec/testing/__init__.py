"""Support code shared by tests/ and bench/ (bench never imports tests/): reference maths, model
folders, the exactness checks' statistics and replay record (exactness), and the exactness hunt's
harness (hunt). Nothing here runs in the edge or the verifier."""
