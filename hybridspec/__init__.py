"""Tools that need both ends installed: the demo (a verifier and an edge on one machine)."""
