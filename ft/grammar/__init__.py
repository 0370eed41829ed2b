"""Structured output: grammars that constrain what a request may generate (llguidance).

`spec` is plain data (what a request asks for; `tool_parameters` what a tool's parameter schema
says of a call's values, for the formats that write them as text), `compiled` turns it into
matchers (in a worker process first, so a hostile grammar cannot hang or crash the server),
`masks` applies them in a model step. Importing this package imports none of them.
"""
