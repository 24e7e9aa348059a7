"""Tools that need both ends installed: the demo (a verifier and an edge on one machine).

Also hybridspec.launch, which starts the servers as processes (standard library only, so any
package may import it), and hybridspec.testing, what tests/ and bench/ share.
"""
