"""Structured output: grammars that constrain what a request may generate (llguidance).

`spec` is plain data (what a request asks for), `compiled` turns it into matchers (in a worker
process first, so a hostile grammar cannot hang or crash the server), `masks` applies them in a
model step. Importing this package imports none of them.
"""
